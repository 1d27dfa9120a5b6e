"""A consolidated save assembles each full tensor in host memory, not on rank 0's GPU.

One process plays rank 0 of 2 on the fake backend (its receives return at once and move no data,
so values are not checked here; tests/parallel/test_consolidated.py checks them on gloo ranks):
a DTensor sharded over both ranks on CUDA is gathered, and the device's peak memory during the
gather must stay within what it held plus one received piece, while the full tensor comes back
in host memory.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_moe.checkpoint.consolidated import gather_full

pytestmark = pytest.mark.gpu

ROWS, COLS = 4096, 4096  # 64 MiB in fp32: far above the allocator's rounding


def test_the_full_tensor_is_assembled_in_host_memory():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cuda", (2,))
        value = distribute_tensor(torch.zeros(ROWS, COLS, device="cuda"), mesh, [Shard(0)])
        piece_bytes = value.to_local().nbytes
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        full = gather_full(value, dst=0)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    finally:
        dist.destroy_process_group()
    assert full.device.type == "cpu" and tuple(full.shape) == (ROWS, COLS)
    assert peak <= piece_bytes, f"the gather held {peak} bytes on the GPU; at most one piece, {piece_bytes}"
