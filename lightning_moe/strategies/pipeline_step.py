"""`PipelineDriver`: how `MoEStrategy` runs a pipeline schedule inside Lightning's training step.

Lightning has no pipeline parallelism; as NeMo 2 did with Megatron's schedules, the strategy takes
over the optimisation step's forward and backward:

* at setup the network is split into stages and trimmed to this rank's
  (:class:`~lightning_moe.parallel.pipeline.runner.PipelineRunner`) inside the model preparation,
  after the tensor and expert layout and before FSDP2 sharding (:meth:`PipelineDriver.prepare`
  gives ``prepare_model_once`` the hook), so only this rank's stages are sharded, over their own
  ``dp`` / ``edp`` groups (the meshes are per pipeline stage); Lightning's own backward and
  ``zero_grad`` are switched off (``fit_loop._skip_backward``, the switch Lightning's
  ``StochasticWeightAveraging`` uses);
* ``training_step`` zeroes the gradients, sets the aux/z-loss gradient scale (1: the schedule
  divides every gradient by the number of micro-batches), runs the schedule on the batch split in
  micro-batches, reduces the gradients once, and logs the loss from the last stage, identical
  on every rank, as ``train_loss``; the loop then clips (one global norm, over ``pp`` too) and
  steps as usual;
* ``validation_step`` runs the forward-only schedule and hands the micro-batch losses to the
  module's ``pipeline_validation_step`` (below), or logs their plain mean as ``val_loss``;
* under context parallelism the strategy cuts each batch to this CP rank's chunks before either
  step, so every stage runs on them; ``pipeline_loss`` returns this CP rank's share of the
  whole-sequence mean (as the CP training loss: ``cp_token_mean``) and the logged losses are the
  whole sequences' means (with or without FSDP2 sharding).

Protocol of the LightningModule: batches are ``(inputs, targets)``; it defines
``pipeline_loss(outputs, targets) -> Tensor`` (one micro-batch's mean loss, on the last stage);
optionally ``pipeline_num_targets(targets) -> Tensor`` (the number of targets a micro-batch's
``targets`` keep, a 0-d integer tensor), which makes ``train_loss`` and the gradients the mean per
target of the whole batch, as at PP=1, however the kept targets fall into micro-batches (without
it each micro-batch counts ``1 / num_microbatches``, as in gradient accumulation); the network to split is its one child that declares its pipeline parts: ``parallel_plan()`` with a
``pipeline`` (:mod:`lightning_moe.parallel.model_plan`; :class:`~lightning_moe.models.MoETransformer`
does) or ``pipeline_parts()`` (:mod:`lightning_moe.parallel.pipeline.split`).

Optionally it defines ``pipeline_validation_step(losses, targets, batch_idx)``, called on every
rank in place of its ``validation_step`` (which needs the whole network) after the forward-only
schedule of a validation batch: ``losses`` is an fp32 ``[M]`` tensor on the device, entry ``m``
``pipeline_loss`` of micro-batch ``m``, identical on every rank (broadcast from the last stage);
``targets`` is the batch's whole targets, of which micro-batch ``m`` holds the ``m``-th of ``M``
equal slices along dimension 0 (under context parallelism: this CP rank's chunks of them, and
``losses`` the whole sequences' means, see :class:`~lightning_moe.parallel.pipeline.runner.PipelineRunner`).
The hook logs what the module wants (with ``self.log``; it can
count each micro-batch's targets on the device, without a host read, and weigh its loss by them,
as :meth:`~lightning_moe.lit.MoELanguageModel.pipeline_validation_step` does for a ``val_loss``
and ``val_ppl`` per target token equal to PP=1's); its return value is the step's output. Every
rank holds the same values, so a metric summed over all ranks keeps its ratios. Without the
hook the driver logs ``val_loss``: the plain mean of the micro-batch losses, averaged over the
batches and ranks (``sync_dist=True``), which weighs a micro-batch with few targets as much as a
full one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from lightning_moe.compat import set_skip_backward
from lightning_moe.parallel.config_error import ConfigError
from lightning_moe.parallel.model_plan import plan_of
from lightning_moe.parallel.pipeline.runner import (
    PipelineRunner,
    check_pipeline_options,
    sharded_schedule_problem,
)

__all__ = ["PipelineDriver", "pipeline_refusal"]


def _network(module: nn.Module) -> nn.Module:
    found = [m for m in module.children() if (plan := plan_of(m)) is not None and plan.pipeline is not None]
    if len(found) != 1:
        raise TypeError(
            f"pipeline_parallel_size > 1 splits the LightningModule's network into stages, but "
            f"{type(module).__name__} has {len(found)} children that declare pipeline parts (parallel_plan() "
            "with a pipeline, as MoETransformer, or pipeline_parts(); it needs exactly one; see "
            "lightning_moe.parallel.pipeline.split)."
        )
    return found[0]


def pipeline_refusal(fn: str) -> str:
    """Why ``Trainer.<fn>`` (``test`` or ``predict``) cannot run under pipeline parallelism, and the way out."""
    return (
        f"Trainer.{fn} (only fit and validate run the schedules; the checkpoint loads at any layout: run {fn} with "
        "pipeline_parallel_size=1, or `lightning-moe generate CKPT`)"
    )


class PipelineDriver:
    """The Lightning side of pipeline parallelism for one strategy (see the module docstring).

    Args:
        schedule: ``MoEStrategy(pipeline_schedule=...)``: ``"1F1B"`` (default), ``"GPipe"``,
            ``"Interleaved1F1B"`` (``virtual_stages >= 2``) or ``"ZBVZeroBubble"`` (zero bubble,
            V-shaped: exactly 2 stages per rank, the first and last stage on PP rank 0).
        num_microbatches: ``num_microbatches``: micro-batches each Lightning batch is split into
            (the batch size must be a multiple; None: 1). Use it instead of ``accumulate_grad_batches``.
        virtual_stages: ``virtual_stages``: stages per PP rank (None: what the schedule needs).
        layer_split: ``pipeline_layer_split``: blocks per stage, in stage order (None: as even as
            possible, earlier stages first; the embedding rides with stage 0, norm and head with the last).
    """

    @classmethod
    def create(
        cls, pipeline_parallel_size: int, schedule: str, num_microbatches: int | None, virtual_stages: int | None,
        layer_split: Sequence[int] | None,
    ) -> PipelineDriver | None:
        """A driver for ``pipeline_parallel_size > 1`` (options checked now), None without PP."""
        if pipeline_parallel_size == 1:
            return None
        return cls(schedule, num_microbatches, virtual_stages, layer_split)

    def __init__(
        self, schedule: str, num_microbatches: int | None, virtual_stages: int | None,
        layer_split: Sequence[int] | None,
    ) -> None:
        self.num_microbatches, self.virtual_stages = check_pipeline_options(schedule, num_microbatches, virtual_stages)
        self.schedule = schedule
        self.layer_split = layer_split
        self.runner: PipelineRunner | None = None

    def prepare(self, strategy: Any, trainer: Any) -> Callable[[nn.Module], list[nn.Module]]:
        """Refuse what PP cannot run; returns the ``split`` hook of ``prepare_model_once``.

        The hook splits and trims the network (:class:`PipelineRunner`) and returns the modules
        to shard: this rank's blocks and pieces.
        """
        self._check(strategy, trainer)

        def split(_model: nn.Module) -> list[nn.Module]:
            self.runner = self._runner(strategy)
            return self.runner.shard_units()

        return split

    def _runner(self, strategy: Any) -> PipelineRunner:
        module = strategy.lightning_module
        return PipelineRunner(
            _network(module), strategy.parallel_context, self.schedule, self.num_microbatches,
            module.pipeline_loss, strategy.root_device, self.virtual_stages, self.layer_split,
            num_targets=getattr(module, "pipeline_num_targets", None),
        )

    def setup(self, strategy: Any, trainer: Any) -> None:
        """After the model preparation: split the network now if it was prepared already, switch off Lightning's backward."""
        if self.runner is None:  # the model held this layout already: prepare_model_once did not split it
            self.runner = self._runner(strategy)
        set_skip_backward(trainer, True)  # the schedule runs the backward: Lightning must not

    def _check(self, strategy: Any, trainer: Any) -> None:
        module = strategy.lightning_module
        problems = []
        fn = getattr(trainer.state.fn, "value", trainer.state.fn)  # "test", not "TrainerFn.TESTING"
        if fn in ("test", "predict"):
            problems.append(pipeline_refusal(fn))
        if not module.automatic_optimization:
            problems.append("manual optimization (the schedule runs forward and backward itself)")
        if trainer.accumulate_grad_batches != 1:
            problems.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches} (use num_microbatches: "
                            "each batch is split into that many micro-batches)")
        if strategy._grad_scaler is not None:
            problems.append("precision='16-mixed' (its GradScaler would have to scale the loss inside the "
                            "schedule; use 'bf16-mixed' or 32)")
        if not strategy.checkpointing.sharded:
            problems.append("save_distributed_checkpoint=False (rank 0's file would hold its own stages' weights "
                            "only; use the sharded checkpoints, or lightning-moe export for one file)")
        if problem := sharded_schedule_problem(self.schedule, getattr(strategy, "sharding_strategy", "NO_SHARD")):
            problems.append(problem)
        if not callable(getattr(module, "pipeline_loss", None)):
            problems.append(f"{type(module).__name__} without pipeline_loss(outputs, targets)")
        if problems:
            raise ConfigError("pipeline_parallel_size > 1 does not support: " + "; ".join(problems) + ".")

    def training_step(self, strategy: Any, batch: Any, batch_idx: int) -> Tensor:
        """Zero the gradients, run the schedule on ``batch``, reduce once; returns (and logs) the loss."""
        assert self.runner is not None
        for optimizer in strategy.optimizers:
            optimizer.zero_grad(set_to_none=True)
        strategy._safeguards.before_backward(1, strategy.parallel_context, None)
        inputs, targets = batch[0], batch[1]
        with strategy.precision_plugin.train_step_context():
            loss = self.runner.step(inputs, targets, strategy._grad_sync)
        strategy.lightning_module.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    @staticmethod
    def merge_param_groups(state: dict[str, Any], ctx: Any) -> dict[str, Any]:
        """An optimizer state of :meth:`MoECheckpointing.optimizer_state` with every stage's parameter names.

        Each stage's ranks name only their own parameters in the param groups; the checkpoint's
        metadata (written by rank 0) must list the whole model's, so that a PP=1 run can check its
        groups against it. Collective over ``pp``; the names are concatenated in PP-rank order.
        """
        gathered: list[Any] = [None] * ctx.size("pp")
        dist.all_gather_object(gathered, state["param_groups"], group=ctx.group("pp"))
        merged = [dict(group, params=[n for stage in gathered for n in stage[i]["params"]])
                  for i, group in enumerate(state["param_groups"])]
        return {**state, "param_groups": merged}

    def validation_step(self, strategy: Any, batch: Any, batch_idx: int) -> Any:
        """The forward-only schedule; its micro-batch losses (the last stage's, on every rank) go to the
        module's ``pipeline_validation_step`` (returns what it returns), or their mean is logged as
        ``val_loss`` and returned (see the module docstring)."""
        assert self.runner is not None
        with strategy.precision_plugin.val_step_context():
            losses = self.runner.eval_microbatches(batch[0], batch[1])
        module = strategy.lightning_module
        hook = getattr(module, "pipeline_validation_step", None)
        if callable(hook):
            return hook(losses, batch[1], batch_idx)
        loss = losses.mean()
        module.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss
