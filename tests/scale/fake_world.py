"""Scale test harness: one process plays rank ``r`` of a world of ``W`` on torch's fake backend.

The ``fake`` process group (``torch.testing._internal.distributed.fake_pg``) answers every
collective at once without communicating, so ``build_parallel_context`` and ``parallelize`` run as
they would on rank ``r`` of a real job. Models are built on the meta device: shapes, placements and
local shards are real, no storage is allocated. A DeepSeek-V3 at world 1024 builds and
parallelises in about a second on one CPU core.

What this cannot show: anything that needs real data or a device (GPU streams, NCCL bandwidth,
communicator memory, allocator fragmentation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from models.test_presets import load_preset
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelContext, ParallelDims, build_parallel_context, parallelize

__all__ = ["Sharded", "local_numel", "sharded_preset"]


def local_numel(param: torch.Tensor) -> int:
    """Elements this rank holds of ``param``: its local shard for a DTensor, else all of it."""
    return (param.to_local() if isinstance(param, DTensor) else param).numel()


@dataclass
class Sharded:
    """A preset built on meta and parallelised on one fake rank."""

    config: MoETransformerConfig
    dims: ParallelDims
    ctx: ParallelContext
    model: nn.Module

    def local_parameters(self) -> int:
        """Parameter elements held by this rank."""
        return sum(local_numel(p) for p in self.model.parameters())


def sharded_preset(
    name: str,
    dims: ParallelDims,
    rank: int,
    sharding_strategy: str = "NO_SHARD",
    config: MoETransformerConfig | None = None,
) -> Sharded:
    """Build preset ``name`` on meta and ``parallelize`` it as ``rank`` of ``dims``.

    ``config``: the preset's config with changes (fewer layers), in place of the preset's own.
    Must run inside `fake_rank` (``parallelize`` creates DTensors on the context's meshes)."""
    config = load_preset(name) if config is None else config
    with torch.device("meta"):
        model = MoETransformer(config)
    ctx = build_parallel_context(dims, "cpu")
    parallelize(model, ctx, sharding_strategy=sharding_strategy)
    return Sharded(config, dims, ctx, model)
