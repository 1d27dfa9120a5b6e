"""Token dispatchers over expert parallelism: ``alltoall`` and ``allgather``.

Each implements the protocol of :mod:`lightning_moe.layers.dispatch` and keeps a
:class:`DispatchStats` of the bytes it moved.
"""

from __future__ import annotations

from lightning_moe.layers.config import MoEConfig
from lightning_moe.parallel.context import ParallelContext
from lightning_moe.parallel.dispatchers.allgather import AllGatherDispatcher
from lightning_moe.parallel.dispatchers.alltoall import AllToAllDispatcher
from lightning_moe.parallel.dispatchers.stats import DispatchStats

__all__ = ["DISPATCHERS", "AllGatherDispatcher", "AllToAllDispatcher", "DispatchStats", "make_dispatcher"]

DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
"""Dispatcher classes by the name used in configs (``MoEStrategy(dispatcher=...)``)."""


def make_dispatcher(name: str, config: MoEConfig, ctx: ParallelContext):
    """The dispatcher called ``name`` for a layer with ``config`` on the layout of ``ctx``."""
    try:
        cls = DISPATCHERS[name]
    except KeyError:
        raise ValueError(f"Unknown dispatcher {name!r}; choose one of {sorted(DISPATCHERS)}.") from None
    return cls(config, ctx)
