"""The launcher of ``devices=N`` (rank 0 starts ranks 1..N-1) when the job fails: nothing left behind.

The script below is what a user runs: rank 0 launches the others through `MoEStrategy`'s launcher
and the ranks play a job in trouble (one stopped by SIGSTOP, one failing, the others waiting as in
a collective). Children take their part before importing anything, so only rank 0 pays for the
imports. Oracle: the operating system: every pid a rank wrote is gone once the job has ended, and
stderr names the rank that failed first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = '''
import os, signal, sys, time
rank, scenario, pids = int(os.environ.get("LOCAL_RANK", "0")), sys.argv[1], sys.argv[2]
if rank > 0:
    with open(os.path.join(pids, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1 and scenario == "child_fails":
        time.sleep(0.5)
        sys.exit(3)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(120)  # waits for a peer, as in a collective that never completes
    sys.exit(0)

import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning_moe.strategies import MoEStrategy

strategy = MoEStrategy(parallel_devices=[torch.device("cpu")] * 3, cluster_environment=LightningEnvironment())
strategy._configure_launcher()
strategy.launcher.grace_s = 1.0

def rank_zero():
    deadline = time.monotonic() + 30
    while len(os.listdir(pids)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    if scenario == "rank0_fails":
        raise ValueError("rank 0 broke")
    time.sleep(120)

strategy.launcher.launch(rank_zero)
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(("scenario", "first"), [("rank0_fails", "rank 0 failed first (ValueError: rank 0 broke)"),
                                                  ("child_fails", "rank 1 failed first (exit code 3)")])
def test_a_failed_job_ends_every_rank_and_names_the_first_failure(tmp_path: Path, scenario: str, first: str):
    script, pids = tmp_path / "job.py", tmp_path / "pids"
    script.write_text(SCRIPT)
    pids.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    log = tmp_path / "stderr.txt"
    try:
        with open(log, "w") as stderr:  # a file, not a pipe: ranks left behind would hold a pipe open
            job = subprocess.run([sys.executable, str(script), scenario, str(pids)], env=env, stderr=stderr,
                                 stdout=subprocess.DEVNULL, timeout=90)
        # Rank 0 exited. After a failure of rank 0 its reaper ends the others within 2 x 1 s grace.
        deadline = time.monotonic() + 6
        ranks = {int(p.stem): int(p.read_text()) for p in pids.glob("*.pid")}
        while (any(_alive(pid) for pid in ranks.values()) or "ended rank" not in log.read_text()) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        job.stderr = log.read_text()
        assert sorted(ranks) == [1, 2]
        assert {r: _alive(pid) for r, pid in ranks.items()} == {1: False, 2: False}, job.stderr[-3000:]
        assert job.returncode != 0
        assert first in job.stderr, job.stderr[-3000:]
        assert "rank 2 (pid" in job.stderr and "was stopped" in job.stderr, job.stderr[-3000:]
    finally:
        for pid_file in pids.glob("*.pid"):
            pid = int(pid_file.read_text())
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


THREADS_SCRIPT = '''
import os, sys
rank, out = int(os.environ.get("LOCAL_RANK", "0")), sys.argv[1]
if rank > 0:  # what the rank's torch reads when it starts: its intra-op thread count
    with open(os.path.join(out, f"{rank}.txt"), "w") as f:
        f.write(os.environ.get("OMP_NUM_THREADS", "unset"))
    sys.exit(0)

import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning_moe.strategies import MoEStrategy

strategy = MoEStrategy(parallel_devices=[torch.device("cpu")] * 3, cluster_environment=LightningEnvironment())
strategy._configure_launcher()

def rank_zero():
    with open(os.path.join(out, "0.txt"), "w") as f:
        f.write(str(torch.get_num_threads()))

strategy.launcher.launch(rank_zero)
'''


def test_every_rank_gets_its_share_of_the_cores(tmp_path: Path):
    """Ranks on one machine split its cores: a rank running as many threads as there are cores
    oversubscribes them N times, and OpenMP regions then wait for descheduled threads (a CPU fit of
    4 ranks on 2 cores ran 3x slower). Oracle: Lightning's own rule, cores // ranks, at least 1."""
    from lightning.fabric.utilities.distributed import _suggested_max_num_threads

    script, out = tmp_path / "job.py", tmp_path / "threads"
    script.write_text(THREADS_SCRIPT)
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "OMP_NUM_THREADS")}
    job = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True, timeout=90)
    assert job.returncode == 0, job.stderr[-3000:]
    deadline = time.monotonic() + 10
    while len(list(out.glob("*.txt"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    want = str(_suggested_max_num_threads(3))
    assert {int(p.stem): p.read_text() for p in out.glob("*.txt")} == {0: want, 1: want, 2: want}
