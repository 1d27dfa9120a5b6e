"""Transient memory of the uneven all-gather and reduce-scatter: at most twice their output.

A dispatch all-gathers each rank's routed rows to every rank of the expert-TP group, and its
backward reduce-scatters them. Sending the local rows once per peer (``x.repeat(world)``)
allocates ``world x`` the local rows on top of the output; receiving every peer's copy of one's
own rows at once (an all-to-all) allocates ``world x`` the output. At a skewed layout either is
several times the rows the rank ends up holding. The check counts, with a dispatch mode, the bytes
of every new storage created by the call (an upper bound on its peak) and compares them with the
output's bytes. Host-side sizes only: the call must not read the device either, so the mode also
fails on any ``.item()`` / ``.tolist()``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_moe.parallel.collectives import all_gather_v, reduce_scatter_v

pytestmark = pytest.mark.distributed

# Rank 3 holds most rows: the world-times copy of its rows is 2.5x what it gathers, and receiving
# every rank's copy of its 5 rows at once 4x what its reduce-scatter keeps.
SIZES = [1, 1, 1, 5]
WIDTH = 8


class _NewStorageBytes(TorchDispatchMode):
    """Sums the bytes of every storage an op creates (not aliasing one of its inputs)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        seen = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
        return out


def _measure(rank: int, world_size: int) -> dict:
    x = torch.full((SIZES[rank], WIDTH), float(rank + 1), requires_grad=True)
    with _NewStorageBytes() as gather:
        y = all_gather_v(x, SIZES, dist.group.WORLD)
    expected = torch.cat([torch.full((n, WIDTH), float(r + 1)) for r, n in enumerate(SIZES)])
    g = torch.arange(y.numel(), dtype=torch.float32).view_as(y)
    y.backward(g)
    # Backward is the reduce-scatter: every rank sent the same g, so the sum is world_size x own rows.
    start = sum(SIZES[:rank])
    grad_ok = torch.equal(x.grad, world_size * g[start : start + SIZES[rank]])
    mine = _scattered(rank)
    with _NewStorageBytes() as scatter:
        kept = reduce_scatter_v(mine, SIZES, dist.group.WORLD)
    # Oracle: the sum of every rank's input, computed here, sliced to this rank's rows (exact:
    # small integers in fp32, whatever the order of the sum).
    want = sum(_scattered(r) for r in range(world_size))[start : start + SIZES[rank]]
    return {
        "forward_ok": torch.equal(y, expected),
        "grad_ok": grad_ok,
        "scatter_ok": torch.equal(kept, want),
        "gather_bytes": gather.bytes,
        "output_bytes": y.numel() * y.element_size(),
        "scatter_bytes": scatter.bytes,
        "scatter_output_bytes": kept.numel() * kept.element_size(),
        "syncs": gather.syncs + scatter.syncs,
    }


def _scattered(rank: int) -> torch.Tensor:
    """Rank ``rank``'s input of the reduce-scatter: all ``sum(SIZES)`` rows, different on each rank."""
    return torch.arange(sum(SIZES) * WIDTH, dtype=torch.float32).view(-1, WIDTH) * (rank + 1)


def test_uneven_all_gather_and_reduce_scatter_allocate_at_most_twice_their_output(tmp_path):
    results = run_distributed(_measure, len(SIZES), timeout_s=60, tmp_dir=tmp_path)
    for rank, r in enumerate(results):
        assert r["forward_ok"] and r["grad_ok"] and r["scatter_ok"], f"rank {rank}: wrong values {r}"
        assert r["gather_bytes"] <= 2 * r["output_bytes"], (
            f"rank {rank}: all_gather_v created {r['gather_bytes']} bytes for an output of "
            f"{r['output_bytes']} bytes (sizes {SIZES})"
        )
        assert r["scatter_bytes"] <= 2 * r["scatter_output_bytes"], (
            f"rank {rank}: reduce_scatter_v created {r['scatter_bytes']} bytes for an output of "
            f"{r['scatter_output_bytes']} bytes (sizes {SIZES})"
        )
        assert r["syncs"] == 0, f"rank {rank}: {r['syncs']} device-to-host reads in the collectives"
