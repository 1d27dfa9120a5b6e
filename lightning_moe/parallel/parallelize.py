"""`parallelize`: the one entry point that applies every parallel technique, in a fixed order.

Model code is written for one device; this function turns it into its share of a parallel
layout. Order (each step assumes the previous ones):

1. tensor / sequence parallelism of attention and dense layers (arrives with the reference
   model; until then a layout with TP > 1 treats each rank's tokens as its own sequence shard);
2. expert parallelism: :func:`~lightning_moe.parallel.expert_parallel.apply_expert_parallel`
   shards the experts over EP x ETP, binds the token dispatcher and the router's reduce groups.

The Lightning strategy calls it after ``configure_model``; a plain torchrun script calls it
directly after building the model.
"""

from __future__ import annotations

from torch import nn

from lightning_moe.parallel.context import ParallelContext
from lightning_moe.parallel.expert_parallel import apply_expert_parallel

__all__ = ["parallelize"]


def parallelize(model: nn.Module, ctx: ParallelContext, dispatcher: str = "alltoall") -> nn.Module:
    """Apply the parallel layout of ``ctx`` to ``model`` in place and return it.

    Args:
        model: a module built for one device (meta-device parameters are fine).
        ctx: the layout, from :func:`~lightning_moe.parallel.build_parallel_context`.
        dispatcher: token dispatcher of the MoE layers, ``"alltoall"`` or ``"allgather"``.
    """
    return apply_expert_parallel(model, ctx, dispatcher=dispatcher)
