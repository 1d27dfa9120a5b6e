"""Tests of the multi-process test harness ``helpers.dist.run_distributed``."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist
from helpers.dist import DistributedTestError, run_distributed

pytestmark = pytest.mark.distributed

# Short enough to keep the hang test fast, long enough for 2 gloo ranks to rendezvous on a busy
# 2-core machine.
HANG_TIMEOUT_S = 3.0


def _sum_of_ranks(rank, world_size):
    value = torch.tensor(rank, dtype=torch.int64)
    dist.all_reduce(value)
    return value.item()


def _all_reduce_tensor(rank, world_size, base):
    tensor = base + rank
    dist.all_reduce(tensor)
    return tensor


def _rank_and_world(rank, world_size):
    return {"rank": rank, "world_size": world_size, "num_threads": torch.get_num_threads()}


def _rank_one_raises(rank, world_size):
    if rank == 1:
        raise ValueError("deliberate failure on rank one")
    return rank


def _rank_one_hangs(rank, world_size, pid_file):
    if rank == 1:
        pid_file.write_text(str(os.getpid()))
        time.sleep(10_000)
    return os.getpid()


def _rank_one_exits(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


def _assert_no_child_alive():
    # active_children() also reaps finished children, so zombies would show up here as well.
    assert multiprocessing.active_children() == []


def test_all_reduce_of_ranks_on_four_ranks(tmp_path):
    assert run_distributed(_sum_of_ranks, 4, tmp_dir=tmp_path) == [6, 6, 6, 6]


def test_all_reduce_of_tensor_returns_tensors(tmp_path):
    base = torch.arange(3.0)
    results = run_distributed(_all_reduce_tensor, 4, base, tmp_dir=tmp_path)
    expected = 4 * base + 6
    for result in results:
        torch.testing.assert_close(result, expected, rtol=0, atol=0)


def test_results_come_back_in_rank_order_without_tmp_dir():
    results = run_distributed(_rank_and_world, 2)
    assert results == [
        {"rank": 0, "world_size": 2, "num_threads": 1},
        {"rank": 1, "world_size": 2, "num_threads": 1},
    ]
    _assert_no_child_alive()


def test_raising_rank_surfaces_its_traceback(tmp_path):
    with pytest.raises(DistributedTestError) as excinfo:
        run_distributed(_rank_one_raises, 2, tmp_dir=tmp_path)
    message = str(excinfo.value)
    assert "rank 1 raised" in message
    assert "rank 1 failed first" in message
    assert "ValueError: deliberate failure on rank one" in message
    assert "_rank_one_raises" in message
    assert "rank 0" not in message
    _assert_no_child_alive()


def test_hung_rank_is_reported_and_killed(tmp_path):
    pid_file = tmp_path / "hung_rank.pid"
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"rank 1 hung") as excinfo:
        run_distributed(_rank_one_hangs, 2, pid_file, timeout_s=HANG_TIMEOUT_S, tmp_dir=tmp_path)
    elapsed = time.monotonic() - start
    assert elapsed < 3 * HANG_TIMEOUT_S, f"took {elapsed:.1f} s"
    assert "rank 0" not in str(excinfo.value)
    _assert_no_child_alive()
    with pytest.raises(ProcessLookupError):  # killed and reaped, not merely orphaned
        os.kill(int(pid_file.read_text()), 0)


def test_rank_dying_without_report_gives_exit_code(tmp_path):
    with pytest.raises(DistributedTestError, match=r"rank 1 exited with code 3 without reporting"):
        run_distributed(_rank_one_exits, 2, tmp_dir=tmp_path)
    _assert_no_child_alive()


def test_error_maxima_keep_nan():
    """The tests' worst-error bookkeeping fails on NaN (plain ``max(0.0, nan)`` is 0.0 and passes)."""
    import math

    from helpers.asserts import exceeds, worst_error

    assert max(0.0, math.nan) == 0.0  # the pattern this replaces
    assert math.isnan(worst_error(0.0, math.nan)) and math.isnan(worst_error(math.nan, 0.0))
    assert worst_error(1e-7, 2e-7) == 2e-7
    assert exceeds(math.nan, 1e-5) and exceeds(2e-5, 1e-5) and not exceeds(1e-6, 1e-5)
