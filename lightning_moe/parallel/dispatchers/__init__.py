"""Token dispatchers over expert parallelism: ``alltoall``, ``allgather`` and ``flex``.

Each implements the protocol of :mod:`lightning_moe.layers.dispatch` and keeps a
:class:`DispatchStats` of the bytes it moved. ``flex`` has backends (``flex_backend``): pure
PyTorch, or DeepEP's fused kernels on CUDA where ``deep_ep`` is installed.
"""

from __future__ import annotations

from lightning_moe.layers.config import MoEConfig
from lightning_moe.parallel.dispatchers.allgather import AllGatherDispatcher
from lightning_moe.parallel.dispatchers.alltoall import AllToAllDispatcher
from lightning_moe.parallel.dispatchers.flex import FLEX_BACKENDS, FlexDispatcher, make_flex_dispatcher
from lightning_moe.parallel.dispatchers.stats import DispatchStats
from lightning_moe.parallel.layout.groups import ParallelContext

__all__ = [
    "DISPATCHERS", "FLEX_BACKENDS", "AllGatherDispatcher", "AllToAllDispatcher", "DispatchStats", "FlexDispatcher",
    "check_dispatcher", "make_dispatcher",
]

DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher, "flex": FlexDispatcher}
"""Dispatcher classes by the name used in configs (``MoEStrategy(dispatcher=...)``); ``flex`` is
its torch backend's class, :func:`make_dispatcher` picks the backend."""


def check_dispatcher(name: str, flex_backend: str = "auto") -> None:
    """Raise ``ValueError`` for an unknown dispatcher or flex backend name (nothing else is checked)."""
    if name not in DISPATCHERS:
        raise ValueError(f"Unknown dispatcher {name!r}; choose one of {sorted(DISPATCHERS)}.")
    if flex_backend not in FLEX_BACKENDS:
        raise ValueError(f"Unknown flex_backend {flex_backend!r}; choose one of {list(FLEX_BACKENDS)}.")


def make_dispatcher(name: str, config: MoEConfig, ctx: ParallelContext, flex_backend: str = "auto"):
    """The dispatcher called ``name`` for a layer with ``config`` on the layout of ``ctx``.

    ``flex_backend`` (``auto``, ``torch``, ``deepep``) chooses the implementation of ``flex`` and
    is ignored by the other dispatchers (its name is checked all the same).
    """
    check_dispatcher(name, flex_backend)
    if name == "flex":
        return make_flex_dispatcher(config, ctx, flex_backend)
    return DISPATCHERS[name](config, ctx)
