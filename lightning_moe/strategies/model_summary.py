"""The model summary of a sharded model, in global parameter counts.

Lightning's ``ModelSummary`` callback counts ``p.numel()`` of the parameters a rank holds: under
expert parallelism that is one rank's experts (a TP=2/EP=4 model of 263,488 parameters showed
116 K). :class:`GlobalModelSummary` counts every parameter of the whole model once: expert shards
by their global shape, tensor-parallel DTensors by theirs (``DTensor.numel()`` is global).
`MoEStrategy` installs it into the summary callbacks of the Trainer, as Lightning does for
DeepSpeed's ZeRO-3.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import Tensor
from torch.nn.parameter import UninitializedParameter

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
    """``ModelSummary`` whose per-layer and total counts are global (see the module docstring)."""

    @property
    def param_nums(self) -> list[int]:
        """Global parameter count of each summarised layer."""
        return [_count(layer._module.parameters()) for layer in self._layer_summary.values()]

    @property
    def total_parameters(self) -> int:
        """Global parameter count of the model."""
        return _count(self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        """Global count of the parameters that require grad."""
        return _count(p for p in self._model.parameters() if p.requires_grad)


def use_global_model_summary(callbacks: Iterable[object]) -> None:
    """Make every ``ModelSummary`` callback (``RichModelSummary`` too) summarise in global counts."""
    for callback in callbacks:
        if isinstance(callback, ModelSummaryCallback):
            depth = callback._max_depth
            callback._summary = lambda trainer, pl_module, depth=depth: GlobalModelSummary(pl_module, max_depth=depth)
