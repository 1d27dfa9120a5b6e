"""The model summary of a sharded model, in global parameter counts.

Lightning's ``ModelSummary`` callback counts ``p.numel()`` of the parameters a rank holds: under
expert parallelism that is one rank's experts (a TP=2/EP=4 model of 263,488 parameters showed
116 K). :class:`GlobalModelSummary` counts every parameter of the whole model once: expert shards
by their global shape, tensor-parallel DTensors by theirs (``DTensor.numel()`` is global), and
under pipeline parallelism every stage's parameters (summed over the ``pp`` group; the table then
says which stage rank zero holds and how many of the parameters are its own). The model's
torchmetrics ``Metric`` children (``val_loss``, perplexity) are not layers and are left out, and
so are the FLOPs column and the ``Total Flops: 0`` line when nothing measured FLOPs (Lightning
measures them only by running ``example_input_array``).

`MoEStrategy` installs it into the summary callbacks of the Trainer, as Lightning does for
DeepSpeed's ZeRO-3; a ``RichModelSummary`` then prints the same plain table.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.callbacks.model_summary import log
from lightning.pytorch.utilities.model_summary import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import LayerSummary
from torch import Tensor
from torch.nn.parameter import UninitializedParameter
from torchmetrics import Metric

from lightning_moe.compat import format_summary_table
from lightning_moe.parallel.expert_parallel import expert_shard

__all__ = ["GlobalModelSummary", "global_numel", "use_global_model_summary"]


def global_numel(param: Tensor) -> int:
    """Elements of ``param`` in the whole model: an expert shard counts as its global tensor."""
    if isinstance(param, UninitializedParameter):
        return 0
    shard = expert_shard(param)
    return math.prod(shard.global_shape) if shard is not None else param.numel()


def _count(params: Iterable[Tensor]) -> int:
    return sum(global_numel(p) for p in params)


class GlobalModelSummary(ModelSummary):
    """``ModelSummary`` whose per-layer and total counts are global (see the module docstring).

    Args:
        model: the LightningModule.
        max_depth: as Lightning's.
        pipeline: the strategy's :class:`~lightning_moe.parallel.pipeline.runner.PipelineRunner` under
            pipeline parallelism (its ``pp`` group sums the stages' counts: build the summary on
            every rank of it), else None.
    """

    def __init__(self, model: Any, max_depth: int = 1, pipeline: Any = None) -> None:
        self._pipeline = pipeline
        super().__init__(model, max_depth=max_depth)
        self._counts = self._global_counts()

    def summarize(self) -> dict[str, LayerSummary]:
        """Lightning's layer summary without the torchmetrics ``Metric`` modules (they hold no parameters)."""
        summary = super().summarize()
        metrics = [name for name, layer in summary.items() if isinstance(layer._module, Metric)]
        for name in [n for n in summary if any(n == m or n.startswith(m + ".") for m in metrics)]:
            del summary[name]
        return summary

    def _global_counts(self) -> dict[str, Any]:
        local = {
            "layers": {name: _count(layer._module.parameters()) for name, layer in self._layer_summary.items()},
            "total": _count(self._model.parameters()),
            "trainable": _count(p for p in self._model.parameters() if p.requires_grad),
        }
        if self._pipeline is None or self._pipeline.pp == 1:
            return {**local, "stage_total": local["total"]}
        stages: list[Any] = [None] * self._pipeline.pp
        dist.all_gather_object(stages, local, group=self._pipeline.group)  # once, when the summary is built
        layers = {name: sum(s["layers"].get(name, 0) for s in stages) for name in local["layers"]}
        return {"layers": layers, "total": sum(s["total"] for s in stages),
                "trainable": sum(s["trainable"] for s in stages), "stage_total": local["total"]}

    @property
    def param_nums(self) -> list[int]:
        """Global parameter count of each summarised layer (summed over the pipeline stages by name)."""
        return [self._counts["layers"][name] for name in self._layer_summary]

    @property
    def total_parameters(self) -> int:
        """Global parameter count of the model."""
        return self._counts["total"]

    @property
    def trainable_parameters(self) -> int:
        """Global count of the parameters that require grad."""
        return self._counts["trainable"]

    @property
    def note(self) -> str | None:
        """Under pipeline parallelism, which stages this rank holds and how many parameters they have."""
        runner = self._pipeline
        if runner is None or runner.pp == 1:
            return None
        stages = ", ".join(str(s) for s in runner.stage_ids)
        return (
            f"Pipeline parallelism: this rank holds stage {stages} of {runner.num_stages} "
            f"({self._counts['stage_total']:,} parameters); its layers are listed, every count is the whole model's."
        )

    def table(self) -> str:
        """The summary table as Lightning's ``ModelSummary`` callback prints it, FLOPs only when measured."""
        data = self._get_summary_data()
        flops = self.total_flops
        if not flops:
            data = [column for column in data if column[0] != "FLOPs"]
        text = format_summary_table(
            self.total_parameters, self.trainable_parameters, self.model_size, self.total_training_modes, flops, *data
        )
        if not flops:
            text = text.rsplit("\n", 1)[0]  # the "Total Flops" line, 0 without example_input_array
        return text if self.note is None else f"{self.note}\n{text}"


def _on_fit_start(callback: ModelSummaryCallback, trainer: Any, pl_module: Any, pipeline: Any = None) -> None:
    """``ModelSummary.on_fit_start`` with :class:`GlobalModelSummary` (built on every rank, printed on rank zero)."""
    if not callback._max_depth:
        return
    summary = GlobalModelSummary(pl_module, max_depth=callback._max_depth, pipeline=pipeline)
    text = summary.table()
    if trainer.is_global_zero:
        log.info("\n" + text)


def use_global_model_summary(callbacks: Iterable[object], pipeline: Any = None) -> None:
    """Make every ``ModelSummary`` callback (``RichModelSummary`` too) summarise in global counts.

    ``pipeline``: the strategy's ``PipelineRunner`` under pipeline parallelism (None without).
    """
    for callback in callbacks:
        if isinstance(callback, ModelSummaryCallback):
            depth = callback._max_depth
            callback._summary = lambda trainer, pl_module, depth=depth: GlobalModelSummary(
                pl_module, max_depth=depth, pipeline=pipeline)
            callback.on_fit_start = types.MethodType(
                lambda cb, trainer, pl_module: _on_fit_start(cb, trainer, pl_module, pipeline), callback)
