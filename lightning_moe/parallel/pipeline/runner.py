"""Pipeline parallelism: a model's stages on this rank and a ``torch.distributed.pipelining`` schedule.

No Lightning here: :class:`PipelineRunner` is what `MoEStrategy` drives inside its training step,
and what a plain torchrun loop calls itself::

    runner = PipelineRunner(model, ctx, "1F1B", num_microbatches=4, loss_fn=next_token_loss, device=device)
    set_aux_loss_scale(model, 1.0)                   # the schedule scales the aux losses' gradients too
    loss = runner.step(inputs, targets, grad_sync)   # every rank: the batch's mean loss
    optimizer.step()

The schedules are PyTorch's (``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``ZBVZeroBubble``), none
is written here. Semantics (docs/numerics.md, gradient accumulation):

* each batch is split into ``num_microbatches`` equal micro-batches along dimension 0; the loss
  function gives each one's mean loss and the schedule divides every gradient by the number of
  micro-batches once, after the last backward (``scale_grads``), so the gradients equal those of
  ``M``-step gradient accumulation of the same micro-batches. With ``num_targets`` (a function
  counting the targets a micro-batch keeps) each micro-batch's loss is weighed by its share of the
  batch's targets instead (:class:`~lightning_moe.parallel.pipeline.loss.TargetWeightedLoss`), so
  the loss and its gradients are the mean per target of the whole batch, as at PP=1, however the
  kept targets fall into micro-batches (one without any counts for nothing). The MoE aux and z losses inject
  their gradients inside the stages: their scale must be 1 (times strategy factors), because the
  schedule's division applies to their gradients as well;
* replicated gradients are reduced over the data-parallel groups once after the schedule, not
  per micro-batch (:class:`~lightning_moe.parallel.grad_sync.GradSync` is held in ``no_sync`` for
  the schedule's backward passes, which a ``PipelineStage`` only does itself for DDP/FSDP modules);
* sharded (FSDP2) stages: the blocks and pieces of this rank's stages are the ``fully_shard``
  units and each stage module their root (:meth:`PipelineRunner.shard_units`, sharded after the
  trim: FSDP2 cannot drop parameters afterwards). Torch's own FSDP stage handling stays off (the
  schedule gets a plain module around each stage): by default every micro-batch's backward
  reduce-scatters its gradients into the shards, so no rank holds unsharded gradients across
  micro-batches; with :class:`~lightning_moe.parallel.sharded_grad_sync.ShardedGradSync`'s
  ``defer_gradient_reduction`` the reduce-scatters are held off for the schedule and started once
  after it (``reduce_accumulated``). Either way the division by the number of micro-batches
  follows the last reduction instead of the schedule's ``scale_grads``;
* the loss is computed on the rank holding the last stage and broadcast over the pipeline group,
  so every rank returns the same values: :meth:`PipelineRunner.step` and
  :meth:`PipelineRunner.eval` the mean of the micro-batch losses,
  :meth:`PipelineRunner.eval_microbatches` the ``M`` losses themselves (one broadcast), for means
  weighted by each micro-batch's number of targets;
* context parallelism (the reference transformer only): the inputs and targets are this CP rank's
  chunks of each sequence (cut before the runner, the same chunks for both), and so are the hidden
  states between stages; the blocks attend over the CP group and use the chunks' global rotary
  positions (:mod:`~lightning_moe.parallel.pipeline.split`). ``loss_fn`` returns this CP rank's
  share of the whole-sequence mean, as the CP training loss does
  (:func:`~lightning_moe.parallel.context_parallel.apply.cp_token_mean`: its gradients, reduced
  over DP x CP, are the whole sequence's); the runner averages the shares over ``cp`` after the
  broadcast, so every rank returns the whole-sequence means;
* when a stage raises, its rank tells the others, which raise
  :class:`~lightning_moe.parallel.pipeline.stage_failure.PipelineStageError` naming that stage and its
  error instead of their transport's "Connection closed by peer" (:mod:`~lightning_moe.parallel.pipeline.stage_failure`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from lightning_moe.compat import is_runtime_schedule, keep_forward_actions
from lightning_moe.parallel.gradient_sync import GradientSync
from lightning_moe.parallel.layout.groups import ParallelContext
from lightning_moe.parallel.model_plan import plan_of
from lightning_moe.parallel.pipeline.loss import TargetWeightedLoss
from lightning_moe.parallel.pipeline.split import (
    StageModule,
    layer_split,
    num_blocks_before_trim,
    pipeline_parts_of,
    stage_indices,
    stage_to_rank,
    trim_to_stages,
)
from lightning_moe.parallel.pipeline.stage_failure import describe_peer_failure, publish_failure

__all__ = ["PIPELINE_SCHEDULES", "PipelineRunner", "check_pipeline_options", "sharded_schedule_problem"]


PIPELINE_SCHEDULES = {
    # name: (schedule class, virtual stages it needs (None: any >= 2), stage placement)
    "GPipe": (ScheduleGPipe, 1, "loop"),
    "1F1B": (Schedule1F1B, 1, "loop"),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, None, "loop"),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, 2, "v"),
}
"""Values of ``pipeline_schedule`` and what each needs."""


def check_pipeline_options(schedule: str, num_microbatches: int | None, virtual_stages: int | None) -> tuple[int, int]:
    """Validate the pipeline options; returns ``(num_microbatches, virtual_stages)`` resolved.

    ``num_microbatches`` None: 1. ``virtual_stages`` None: what the schedule needs (2 for the
    interleaved and V schedules).
    """
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline_schedule={schedule!r}; choose one of {list(PIPELINE_SCHEDULES)}.")
    _, needed, _ = PIPELINE_SCHEDULES[schedule]
    virtual = virtual_stages if virtual_stages is not None else (needed or 2)
    if needed is not None and virtual != needed:
        raise ValueError(
            f"pipeline_schedule={schedule!r} runs exactly {needed} stage(s) per rank, got virtual_stages={virtual}; "
            f"pass virtual_stages={needed} (or None), or use "
            f"{'Interleaved1F1B' if needed == 1 else '1F1B'} for {'several stages' if needed == 1 else 'one stage'} "
            "per rank."
        )
    if needed is None and virtual < 2:
        raise ValueError(f"pipeline_schedule={schedule!r} interleaves stages: virtual_stages must be >= 2, got {virtual}.")
    micro = 1 if num_microbatches is None else int(num_microbatches)
    if micro < 1:
        raise ValueError(f"num_microbatches={num_microbatches}: needs at least 1 micro-batch per batch.")
    return micro, virtual


_ZBV_SHARDED = ("its separate weight-gradient passes run outside FSDP2's backward hooks, so those gradients would "
                "be lost; use '1F1B' or 'Interleaved1F1B', or sharding_strategy='NO_SHARD'")


def sharded_schedule_problem(schedule: str, sharding_strategy: str) -> str | None:
    """Why ``schedule`` cannot run stages sharded with ``sharding_strategy``, None if it can.

    The zero-bubble schedule computes the weight gradients in separate passes after each
    micro-batch's input-gradient pass, outside FSDP2's backward hooks: its sharded stages ended
    the step with zero gradients for those weights.
    """
    if schedule == "ZBVZeroBubble" and sharding_strategy != "NO_SHARD":
        return f"pipeline_schedule='ZBVZeroBubble' with sharding_strategy={sharding_strategy!r} ({_ZBV_SHARDED})"
    return None


def _probe(module: StageModule, x: Tensor) -> tuple[Tensor, tuple | None]:
    """``module``'s output on ``x`` and the (mesh dim names, placements) it had before going local."""
    seen: dict[str, tuple] = {}

    def hook(_module, _inputs, output):
        if isinstance(output, DTensor):
            seen["layout"] = (tuple(output.device_mesh.mesh_dim_names or ()), tuple(output.placements))

    blocks = list(module.blocks.values())
    handle = blocks[-1].register_forward_hook(hook) if blocks and not module.is_last else None
    try:
        out = module(x)
    finally:
        if handle is not None:
            handle.remove()
    return out, seen.get("layout")


SCHEDULES_KEPT = 2
"""Schedules a :class:`PipelineRunner` keeps per mode (training, evaluation): the batch shapes
most recently used (a full batch and a shorter last one, say). An older one is dropped, with its
stages' receive buffers, and built again (one shape probe) if its shape comes back."""


class _PlainStage(nn.Module):
    """A sharded stage module as torch's ``PipelineStage`` is given it: a plain module around it.

    ``PipelineStage`` handles an ``FSDPModule`` itself: it turns off the reduce-scatters and keeps
    the parameters gathered from the first micro-batch's backward to the last (``set_requires_gradient_sync(False)``,
    ``set_reshard_after_backward(False)``), so every rank would hold its stages' full parameters and
    gradients for the whole schedule. :class:`~lightning_moe.parallel.sharded_grad_sync.ShardedGradSync`
    decides instead (by default a reduce-scatter per micro-batch).
    """

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: Tensor) -> Tensor:
        """The stage's forward (through its ``__call__``: the FSDP2 root's hooks run)."""
        return self.stage(x)


def _example(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    # requires_grad on floating tensors: the stage derives from it that a gradient travels back.
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)


class PipelineRunner:
    """This rank's pipeline stages of ``model`` and the schedule that runs them (see the module docstring).

    Trims ``model`` in place to this rank's stages (global parameter names kept:
    :func:`~lightning_moe.parallel.pipeline.split.trim_to_stages`): build optimizers and
    gradient synchronisation afterwards.

    Args:
        model: the network to split (a model whose ``parallel_plan()`` declares its ``pipeline``, such as
            ``MoETransformer``, or a model with ``pipeline_parts()``).
        ctx: the parallel context; its ``pp`` group carries the stage-to-stage traffic.
        schedule: a name of :data:`PIPELINE_SCHEDULES`.
        num_microbatches: micro-batches per batch (the batch size must be a multiple).
        loss_fn: ``(outputs, targets) -> mean loss`` of one micro-batch, on the last stage (under
            context parallelism this CP rank's share of it, see the module docstring).
        device: where the stages compute.
        virtual_stages: stages per rank (None: what the schedule needs).
        split: blocks per stage, in stage order (None: as even as possible).
        num_targets: ``targets -> number of targets kept`` (a 0-d integer tensor) of one
            micro-batch's targets; when given, training weighs each micro-batch's loss by its share
            of the batch's targets (the mean per target of the whole batch), else each counts
            ``1 / num_microbatches``. Evaluation returns the unweighted micro-batch losses either way.
    """

    def __init__(
        self, model: nn.Module, ctx: ParallelContext, schedule: str, num_microbatches: int,
        loss_fn: Callable[[Tensor, Tensor], Tensor], device: torch.device, virtual_stages: int | None = None,
        split: Sequence[int] | None = None, num_targets: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        self.num_microbatches, self.virtual_stages = check_pipeline_options(schedule, num_microbatches, virtual_stages)
        self.schedule_name = schedule
        self.group = ctx.group("pp")
        self.pp = ctx.size("pp")
        self.pp_rank = dist.get_rank(self.group)
        self.device = device
        self.loss_fn = loss_fn
        plan = plan_of(model)
        if ctx.size("cp") > 1 and (plan is None or plan.context_parallel is None):
            raise ValueError(
                f"context_parallel_size={ctx.size('cp')} with pipeline_parallel_size={self.pp} splits only a "
                f"network whose parallel_plan() declares its attention for context parallelism (as "
                f"MoETransformer does), not {type(model).__name__}; declare it (lightning_moe.parallel.model_plan), "
                "or use context_parallel_size=1."
            )
        self._cp_group = ctx.group("cp") if ctx.size("cp") > 1 else None
        self._weighted_loss = None if num_targets is None else TargetWeightedLoss(
            loss_fn, num_targets, self.num_microbatches, self._cp_group)
        parts = pipeline_parts_of(model)
        num_blocks = num_blocks_before_trim(model, parts)  # a model trimmed by an earlier run counts them all
        self.num_stages = self.pp * self.virtual_stages
        counts = layer_split(num_blocks, self.num_stages, split)
        starts = [sum(counts[:s]) for s in range(self.num_stages)]
        self.style = PIPELINE_SCHEDULES[schedule][2]
        self.stage_ids = stage_indices(self.pp_rank, self.pp, self.virtual_stages, self.style)
        last = self.num_stages - 1
        block_ids = {i for s in self.stage_ids for i in range(starts[s], starts[s] + counts[s])}
        trim_to_stages(model, parts, block_ids, 0 in self.stage_ids, last in self.stage_ids)
        self.modules = [
            StageModule(model, parts, list(range(starts[s], starts[s] + counts[s])), s == 0, s == last)
            for s in self.stage_ids
        ]
        self.has_first = 0 in self.stage_ids
        self.has_last = last in self.stage_ids
        self._last_rank = dist.get_global_rank(self.group, stage_to_rank(last, self.pp, self.style))
        self._schedules: OrderedDict[tuple, object] = OrderedDict()  # least recently used first
        self._mesh = ctx.dense_mesh  # the hidden states' layout between stages is a dense one

    def shard_units(self) -> list[nn.Module]:
        """The modules to shard with FSDP2: this rank's stage modules, each the root of its blocks and pieces."""
        return list(self.modules)

    def _sharded(self) -> bool:
        return any(isinstance(m, FSDPModule) for stage in self.modules for m in stage.modules())

    def describe(self) -> str:
        """One line: the schedule and which stages this rank holds."""
        return (
            f"pipeline {self.schedule_name}: {self.num_stages} stages over PP={self.pp}, rank {self.pp_rank} "
            f"holds stages {self.stage_ids}, {self.num_microbatches} micro-batches per batch"
        )

    def _schedule(self, inputs: Tensor, train: bool):
        # A PipelineStage keeps the shapes sent between stages and receive buffers of those shapes:
        # one schedule per micro-batch shape (a shorter last batch, validation batches of other
        # sizes), separate ones for training and forward-only evaluation, the SCHEDULES_KEPT most
        # recently used of each mode kept.
        key = (tuple(inputs.shape), inputs.dtype, train)
        if key in self._schedules:
            self._schedules.move_to_end(key)
        else:
            same_mode = [k for k in self._schedules if k[2] == train]
            for old in same_mode[: max(0, len(same_mode) - SCHEDULES_KEPT + 1)]:
                del self._schedules[old]  # its stages (and their buffers) go with it: nothing else holds them
            if self._sharded() and self.schedule_name == "ZBVZeroBubble":
                raise ValueError(f"PipelineRunner cannot run pipeline_schedule='ZBVZeroBubble' on FSDP2-sharded stages "
                                 f"({_ZBV_SHARDED}).")
            metas = self._stage_metas(inputs)
            stages = [
                PipelineStage(_PlainStage(module) if isinstance(module, FSDPModule) else module, s, self.num_stages,
                              self.device, group=self.group,
                              input_args=_example(*metas[s]), output_args=_example(*metas[s + 1]))
                for module, s in zip(self.modules, self.stage_ids)
            ]
            cls = PIPELINE_SCHEDULES[self.schedule_name][0]
            first = stages[0] if self.virtual_stages == 1 else stages
            # Sharded: the gradients are divided after their reduction, in step().
            loss_fn = self._weighted_loss if train and self._weighted_loss is not None else self.loss_fn
            schedule = cls(first, self.num_microbatches, loss_fn=loss_fn, scale_grads=not self._sharded())
            if not train and is_runtime_schedule(schedule):
                keep_forward_actions(schedule)  # torch 2.13's ZBV eval() still runs its backward actions
            self._schedules[key] = schedule
        return self._schedules[key]

    @torch.no_grad()
    def _stage_metas(self, inputs: Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of every stage boundary for one micro-batch of ``inputs`` (index s: stage s's input).

        Given to each ``PipelineStage``, so it skips its own metadata inference, which runs a
        training-mode forward on uninitialised tensors: that would add garbage to the routers'
        expert-bias counts and global aux-loss statistics. Only the first stage runs, on a real
        micro-batch (its buffers restored afterwards, so nothing a router counts survives): blocks
        keep the hidden states' shape, dtype and layout, so every later boundary has the first
        stage's output meta, and the last stage runs only its head, on zeros of that shape. No
        later stage's blocks run: on synthetic hidden states their routers would send every token
        to the same experts (one expert-parallel rank getting EP times its share). Every rank of a
        stage's TP/EP groups runs it at the same time (their collectives match). One object
        broadcast over ``pp`` for the first stage, one for the last.
        """
        micro = inputs[: inputs.shape[0] // self.num_microbatches]
        metas = [(tuple(micro.shape), micro.dtype)]
        last = self.num_stages - 1
        meta = None
        for s in range(self.num_stages):
            owner = stage_to_rank(s, self.pp, self.style)
            if 0 < s < last:  # a run of blocks: its output is its input's kind
                meta = (metas[s][0], metas[s][1], meta[2])
            else:
                meta = None
                if owner == self.pp_rank:
                    module = self.modules[self.stage_ids.index(s)]
                    saved = [b.clone() for b in module.buffers()]
                    if s == 0:
                        out, layout = _probe(module, micro)
                    else:  # nothing follows the last stage: its output layout is not needed
                        hidden = torch.zeros(metas[s][0], dtype=metas[s][1], device=self.device)
                        out, layout = module.head_only(hidden), None
                    for buffer, value in zip(module.buffers(), saved):
                        buffer.copy_(value)
                    for unit in (m for m in module.modules() if isinstance(m, FSDPModule)):
                        unit.reshard()  # free what the probe gathered (SHARD_GRAD_OP keeps it otherwise)
                    meta = (tuple(out.shape), out.dtype, layout)
                if self.pp > 1:
                    box = [meta]
                    dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, owner), group=self.group,
                                               device=self.device)
                    meta = box[0]
            if s + 1 in self.stage_ids and meta[2] is not None:
                names, placements = meta[2]
                mesh = self._mesh[names[0] if len(names) == 1 else names]
                self.modules[self.stage_ids.index(s + 1)].input_layout = (mesh, placements)
            metas.append(meta[:2])
        return metas

    def _check(self, inputs: Tensor) -> None:
        batch = inputs.shape[0]
        if batch == 0:  # it would split into empty micro-batches that the schedule cannot send
            raise ValueError(
                f"An empty batch (0 samples) reached the pipeline schedule (inputs of shape {tuple(inputs.shape)}): "
                f"every batch needs a multiple of num_microbatches={self.num_microbatches} samples, at least one "
                "per micro-batch; check what the data loader or its collate function returns."
            )
        if batch % self.num_microbatches:
            raise ValueError(
                f"A batch of {batch} samples does not split into num_microbatches={self.num_microbatches} equal "
                "micro-batches; use a batch size that is a multiple of it (and drop_last=True for the last batch)."
            )

    def _run(self, inputs: Tensor, targets: Tensor, train: bool) -> Tensor:
        """Run the schedule on one batch; the fp32 losses, the same on every rank: training their mean,
        evaluation the ``[M]`` micro-batch losses."""
        self._check(inputs)  # raised on every rank alike: no other stage needs telling
        try:
            return self._run_schedule(inputs, targets, train)
        except Exception as err:
            me = dist.get_rank()
            peers = [r for r in dist.get_process_group_ranks(self.group) if r != me]
            caused = describe_peer_failure(err, self.stage_ids, me, peers)
            if caused is not None:
                raise caused from err
            publish_failure(err, self.stage_ids, me)
            raise

    def _run_schedule(self, inputs: Tensor, targets: Tensor, train: bool) -> Tensor:
        schedule = self._schedule(inputs, train)
        args = (inputs,) if self.has_first else ()
        target = targets if self.has_last else None
        losses: list[Tensor] = []
        kwargs = {"target": target, "losses": losses if self.has_last else None}
        if train:
            weighted = self._weighted_loss if self.has_last else None
            if weighted is not None:
                weighted.start(targets)
            schedule.step(*args, return_outputs=False, **kwargs)
            if weighted is not None:
                weighted.finish()
        else:
            # Asked for outputs, a schedule keeps every micro-batch's head output (M x the logits) until
            # the next step; the losses are all evaluation needs.
            schedule.eval(*args, return_outputs=False, **kwargs)
        if self.has_last:
            loss = torch.stack([loss.detach().float() for loss in losses])
            loss = loss.mean() if train else loss
        else:
            loss = torch.zeros(() if train else self.num_microbatches, dtype=torch.float32, device=self.device)
        if self.pp > 1:
            dist.broadcast(loss, src=self._last_rank, group=self.group)
        if self._cp_group is not None:  # each CP rank's share of the whole-sequence mean -> the mean
            dist.all_reduce(loss, group=self._cp_group)
            loss = loss / dist.get_world_size(self._cp_group)
        return loss

    def step(self, inputs: Tensor, targets: Tensor, grad_sync: GradientSync | None = None) -> Tensor:
        """Forward and backward of one batch; returns its mean loss (the same on every rank).

        ``grad_sync`` (a :class:`~lightning_moe.parallel.gradient_sync.GradientSync`, optional) is armed
        for the schedule's backward passes, held in ``no_sync`` until the schedule is done, then
        finished: a ``GradSync`` reduces the gradients once; a
        :class:`~lightning_moe.parallel.sharded_grad_sync.ShardedGradSync` reduce-scattered each
        micro-batch's already (or, deferring, is told to start the reduce-scatters now), and sums
        the tensor-parallel-partial ones. Gradients accumulate into ``param.grad``: zero them before.
        """
        if grad_sync is None:
            loss = self._run(inputs, targets, train=True)
        else:
            grad_sync.begin_backward()
            try:
                with grad_sync.no_sync():
                    loss = self._run(inputs, targets, train=True)
                grad_sync.reduce_accumulated()
            finally:
                grad_sync.end_backward()
            grad_sync.finish()
        if self._sharded():
            self._divide_grads(self.num_microbatches)
        return loss

    @torch.no_grad()
    def _divide_grads(self, factor: int) -> None:
        """What ``scale_grads`` does, on the reduced (sharded) gradients of this rank's stages."""
        if factor == 1:
            return
        for stage in self.modules:
            for param in stage.parameters():
                if param.grad is not None:
                    param.grad.div_(factor)

    @torch.no_grad()
    def eval(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """Forward only (the schedule's ``eval``); returns the batch's mean loss on every rank.

        The plain mean of :meth:`eval_microbatches`, as :meth:`step` returns it.
        """
        return self.eval_microbatches(inputs, targets).mean()

    @torch.no_grad()
    def eval_microbatches(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """Forward only, as :meth:`eval`; returns the ``[M]`` fp32 micro-batch losses, the same on every rank.

        Entry ``m`` is ``loss_fn`` of micro-batch ``m``: ``inputs[m * B // M : (m + 1) * B // M]``
        and the same rows of ``targets`` (the schedule splits along dimension 0 in order; under
        context parallelism the mean of the CP ranks' shares: the whole sequences' loss). A mean
        per target token weighs each by its number of targets (a micro-batch without targets then
        counts for nothing), where :meth:`eval` weighs them equally.
        """
        return self._run(inputs, targets, train=False)
