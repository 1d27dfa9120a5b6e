"""`run_ranks`: planned ranks run in forked processes, exchanging the objects they broadcast.

The rank functions here stand in for `fake_fit_rank` with the same contract: they read and send
objects through ``FakeObjects.sent`` and raise `AwaitsObject` when an object is missing. Planning
real configurations this way is checked against real runs in ``test_plan_vs_measured.py``.
"""

from __future__ import annotations

import os
import sys

import pytest

from lightning_moe.planning.fake_objects import AwaitsObject
from lightning_moe.planning.plan_config import PlanConfigError
from lightning_moe.planning.rank_runs import run_ranks


def _pipeline_like(rank, objects):
    """Rank 0 sends its shapes and needs the last rank's; the last needs rank 0's; the middle ones need both
    (the order in which pipeline stages exchange boundary shapes)."""
    sent = objects.sent
    if rank == 0:
        sent[("first", 0)] = ("shapes of", rank, os.getpid())
    if rank != 0 and ("first", 0) not in sent:
        raise AwaitsObject("first", ("first", 0))
    if rank == 3:
        sent[("last", 0)] = ("head of", rank)
    if ("last", 0) not in sent:
        raise AwaitsObject("last", ("last", 0))
    return rank, sent[("first", 0)][:2], sent[("last", 0)]


@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_ranks_that_wait_for_each_other_are_planned_in_any_number_of_processes(jobs):
    done = run_ranks([0, 3, 1, 2], _pipeline_like, jobs)
    assert done == {r: (r, ("shapes of", 0), ("head of", 3)) for r in range(4)}


def _never_sent(rank, objects):
    raise AwaitsObject("an object nobody sends")


@pytest.mark.parametrize("jobs", [1, 2])
def test_ranks_waiting_only_for_each_other_are_an_error(jobs):
    with pytest.raises(PlanConfigError, match=r"the ranks \[0, 1\] wait for each other"):
        run_ranks([0, 1], _never_sent, jobs)


def _waits_for_a_slow_sender(rank, objects):
    """Rank 1 needs rank 0's object; rank 2 sends another one at once; rank 0 sends its own late.
    Each run is logged to the file in RUN_LOG."""
    import time

    with open(os.environ["RUN_LOG"], "a") as log:
        log.write(f"{rank}\n")
    if rank == 2:
        objects.sent[("other", 0)] = "unrelated"
    if rank == 0:
        time.sleep(1.0)
        objects.sent[("first", 0)] = "shapes"
    if rank == 1 and ("first", 0) not in objects.sent:
        raise AwaitsObject("first", ("first", 0))
    return rank


def test_a_waiting_rank_runs_again_only_once_its_object_is_sent(tmp_path, monkeypatch):
    log = tmp_path / "runs.log"
    monkeypatch.setenv("RUN_LOG", str(log))
    assert run_ranks([1, 2, 0], _waits_for_a_slow_sender, 2) == {0: 0, 1: 1, 2: 2}
    # Rank 2's object arrives while rank 0 still sleeps: rank 1 must not run again for it.
    assert sorted(int(line) for line in log.read_text().split()) == [0, 1, 1, 2]


def _exchanges_through_broadcasts(rank, objects):
    """Ranks 0 and 1 as stage 0 and the last stage: each broadcast by one, received by the other;
    rank 0 sends first, then needs rank 1's. Each run is logged to the file in RUN_LOG."""
    from unittest import mock

    with open(os.environ["RUN_LOG"], "a") as log:
        log.write(f"{rank}\n")
    got = []
    objects.new_rank()
    with mock.patch("torch.distributed.get_rank", return_value=rank):
        for src in (0, 1):
            box = [f"from {rank}" if src == rank else None]
            objects.broadcast_object_list(box, src=src)
            got.append(box[0])
    return got


def test_ranks_that_need_each_others_objects_run_side_by_side_once(tmp_path, monkeypatch):
    log = tmp_path / "runs.log"
    monkeypatch.setenv("RUN_LOG", str(log))
    assert run_ranks([0, 1], _exchanges_through_broadcasts, 2) == {r: ["from 0", "from 1"] for r in (0, 1)}
    # Rank 0 waits for rank 1's object while rank 1 runs: neither is stopped and run again.
    assert sorted(int(line) for line in log.read_text().split()) == [0, 1]
    # One after another, rank 0 stops for the object and runs again once rank 1 has sent it.
    log.unlink()
    assert run_ranks([0, 1], _exchanges_through_broadcasts, 1) == {r: ["from 0", "from 1"] for r in (0, 1)}
    assert [int(line) for line in log.read_text().split()] == [0, 1, 0]


def _with_pid(key, objects):
    return key, os.getpid()


def _two_more_after_the_first_ones(key, result):
    """Runs 0 and 1 each ask for one more run (as stage 0's run asks for the middle stages')."""
    return [key + 10] if key < 10 else []


@pytest.mark.parametrize("jobs", [1, 2])
def test_the_runs_a_finished_run_asks_for_run_in_the_same_workers(jobs):
    done = run_ranks([0, 1], _with_pid, jobs, then=_two_more_after_the_first_ones)
    assert sorted(done) == [0, 1, 10, 11]
    assert all(done[key][0] == key for key in done)
    # The workers take one run after another (what a run warmed up serves the next): no new process.
    pids = {pid for _, pid in done.values()}
    assert len(pids) == jobs and (jobs > 1 or pids == {os.getpid()})


def _refused(rank, objects):
    if rank == 1:
        raise ValueError(f"rank {rank}: this layout is refused")
    return rank


class _Unpicklable(Exception):
    def __init__(self, message, handle):
        super().__init__(message)
        self.handle = handle


def _unpicklable(rank, objects):
    raise _Unpicklable("cannot travel", lambda: None)


def test_a_worker_error_is_raised_in_the_caller():
    with pytest.raises(ValueError, match="rank 1: this layout is refused"):
        run_ranks([0, 1], _refused, 2)
    with pytest.raises(RuntimeError, match=r"(?s)failed in a worker process.*cannot travel"):
        run_ranks([0, 1], _unpicklable, 2)


def _sleeps_forever(rank, objects):
    with open(os.environ["WORKER_PID_FILE"], "w") as f:
        f.write(str(os.getpid()))
    import time
    time.sleep(600)


def test_the_workers_die_with_the_planner(tmp_path, monkeypatch):
    """A planner killed by a signal (no cleanup runs) takes its workers with it (Linux)."""
    import multiprocessing
    import signal
    import time

    if not sys.platform.startswith("linux"):
        pytest.skip("parent-death signals are Linux's")
    pid_file = tmp_path / "worker.pid"
    monkeypatch.setenv("WORKER_PID_FILE", str(pid_file))
    planner = multiprocessing.get_context("fork").Process(target=run_ranks, args=([0, 1], _sleeps_forever, 2))
    planner.start()
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "no worker started"
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    os.kill(planner.pid, signal.SIGKILL)
    planner.join()
    while _alive(worker):
        assert time.monotonic() < deadline, f"worker {worker} outlived the planner"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has died
    except FileNotFoundError:
        return False
