"""One process as rank ``r`` of a world of ``W``: torch's ``fake`` process-group backend.

The ``fake`` backend (``torch.testing._internal.distributed.fake_pg``) answers every collective at
once without communicating, so ``build_parallel_context``, ``parallelize`` and a whole training
step run as they would on rank ``r`` of a real job. With the meta device or ``FakeTensorMode`` no
storage is allocated: a DeepSeek-V3 at world 1024 sets up in seconds on one CPU core.

What this cannot show: anything that needs real values or a device (GPU streams, NCCL bandwidth,
communicator memory, allocator fragmentation).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from lightning_moe.compat import clear_sharding_caches, dtensor_op_dispatcher, register_fake_backend

__all__ = ["fake_rank", "forget_dtensor_layouts"]


@contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """Run the body as ``rank`` of ``world_size`` on the fake backend; the group is destroyed after,
    also when the body raises, so later tests (and forked gloo ranks) start without one, and no
    DTensor layout cached in the body reaches a later rank (`forget_dtensor_layouts`). The process's
    exception hook is given back too (``init_process_group`` wraps it to prefix tracebacks with the
    rank: one wrapper more for every rank played)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_dtensor_layouts()
    hook = sys.excepthook
    dist.init_process_group("fake", store=register_fake_backend()(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_dtensor_layouts()
        sys.excepthook = hook



def forget_dtensor_layouts() -> None:
    """Empty DTensor's caches of op output layouts (its C++ fast path's and the Python ones).

    They key on meshes that compare equal across worlds of one shape (ranks and names, not the
    process's own rank) and hand back the cached layout's mesh: a fake rank played after another in
    one process, or a rank forked from a process that played one, would get DTensors on the
    earlier rank's mesh, whose coordinate is that rank's. A real job has one rank per process,
    where that mesh is always its own."""
    clear_sharding_caches(dtensor_op_dispatcher().sharding_propagator)

