"""The harness itself: `fake_rank` plays the rank asked for and leaves no process group behind."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_moe.planning.fake_world import fake_rank


def test_fake_rank_plays_the_rank_and_tears_down_even_on_failure():
    with fake_rank(1000, 1024):
        assert (dist.get_rank(), dist.get_world_size()) == (1000, 1024)
    assert not dist.is_initialized()
    with pytest.raises(ZeroDivisionError), fake_rank(3, 64):
        1 / 0  # noqa: B018 (the body fails on purpose)
    assert not dist.is_initialized()


def test_fake_rank_gives_the_exception_hook_back():
    """``init_process_group`` wraps ``sys.excepthook`` to prefix tracebacks with ``[rank<r>]``; a
    planner that plays many ranks (``plan --search``: every layout) would stack one wrapper per rank
    and print every line of a traceback behind dozens of prefixes, the rank of the first."""
    hook = sys.excepthook
    for rank in (0, 5):
        with fake_rank(rank, 8):
            pass
        assert sys.excepthook is hook
    with pytest.raises(ZeroDivisionError), fake_rank(3, 8):
        1 / 0  # noqa: B018 (the body fails on purpose)
    assert sys.excepthook is hook


def test_a_later_fake_rank_sees_its_own_mesh_coordinate():
    """DTensor caches each op's output layout, meshes included, keyed by meshes that compare equal
    across fake worlds of one shape (rank layout and names, not the process's rank). A later fake
    rank must not get an earlier one's mesh back from that cache: its DTensors' blocks
    (``parallel/sharded_init.py``'s ``local_block``) would be the earlier rank's."""
    for rank in (0, 5):
        with fake_rank(rank, 8):
            mesh = init_device_mesh("cpu", (8,))
            weight = DTensor.from_local(torch.empty(4, 3, device="meta"), mesh, [Shard(0)], run_check=False)
            assert list(torch.empty_like(weight).device_mesh.get_coordinate()) == [rank]
