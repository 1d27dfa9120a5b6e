"""`MoEStrategy`'s process launcher: when the job fails, no rank it started is left behind.

With ``devices=N`` rank 0 re-runs the script for ranks 1..N-1 (Lightning's
``_SubprocessScriptLauncher``). Lightning's own watcher ends them only when a *child* exits with an
error (by SIGKILL to every process, rank 0 included, without a word on stderr); when rank 0 itself
fails, its children are left running, and a stopped one (SIGSTOP, a debugger, a frozen node
process) stays forever, holding its GPU. :class:`MoESubprocessLauncher` keeps the launch and adds:

* a watcher thread that polls the children every ``poll_s``; the first failure seen, a child's
  non-zero exit or rank 0's exception, is named once on stderr ("rank 2 failed first (exit code
  1)"). When rank 0 raises, the children get ``settle_s`` to show that one of them failed before
  (rank 0's error is then usually its consequence, e.g. a closed connection): they cannot have
  seen rank 0's error yet, rank 0 is still alive and connected;
* then every rank it started that still runs is ended (:mod:`lightning_moe.strategies.reaper`):
  SIGTERM (with SIGCONT, so that a stopped rank receives it), SIGKILL after ``grace_s``; the
  message names the ranks that were stopped and those that had to be killed. When rank 0 failed,
  a small reaper process does that once rank 0 has exited: a rank waiting on rank 0 only sees the
  failure when rank 0's connections close, and then reports its own error (e.g. which pipeline
  stage it lost, :mod:`lightning_moe.parallel.pipeline.stage_failure`) instead of being killed silently;
* when a child failed and rank 0 does not stop by itself within ``grace_s`` after the others were
  ended (it may wait in a collective that never completes), rank 0 exits with status 1.

A launch by torchrun, SLURM or an existing process group starts no process here, so this does
nothing then: that launcher owns the processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_moe.compat import set_num_threads_if_needed, start_child_ranks, subprocess_script_launcher
from lightning_moe.strategies.reaper import end_ranks

__all__ = ["MoESubprocessLauncher", "describe_exit"]

_PREFIX = "lightning_moe launcher:"
# How a rank stopped by SIGTERM exits (MoEStrategy: 128 + SIGTERM; or the signal itself). A job
# told to stop (SLURM) stops every rank this way, each after its part of the checkpoint: not a failure.
_SIGTERM_EXITS = (128 + signal.SIGTERM, -signal.SIGTERM)


def describe_exit(returncode: int) -> str:
    """``"exit code 1"`` or ``"killed by SIGKILL"`` for a ``Popen.returncode``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _summary(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return type(err).__name__ + (f": {lines[0][:300]}" if lines else "")


def _is_sigterm_stop(err: BaseException) -> bool:
    if isinstance(err, SIGTERMException):
        return True
    return isinstance(err, SystemExit) and err.code in (None, 0, *_SIGTERM_EXITS)


def _say(message: str) -> None:
    print(f"{_PREFIX} {message}", file=sys.stderr, flush=True)


class MoESubprocessLauncher(subprocess_script_launcher()):
    """Lightning's subprocess launcher that ends every rank it started when the job fails (see the module docstring).

    Args:
        cluster_environment, num_processes, num_nodes: as Lightning's ``_SubprocessScriptLauncher``.
        grace_s: seconds between SIGTERM and SIGKILL, and the time rank 0 gets to stop by itself
            after a child failed.
        poll_s: how often the children are polled.
        settle_s: after rank 0's exception, how long a child's failure may take to show (it failed first).
    """

    def __init__(self, cluster_environment, num_processes: int, num_nodes: int, grace_s: float = 5.0,
                 poll_s: float = 0.2, settle_s: float = 1.0) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.grace_s, self.poll_s, self.settle_s = grace_s, poll_s, settle_s
        self._lock = threading.Lock()
        self._first: tuple[int, str] | None = None
        self._ended = threading.Event()
        self._main_stopping = threading.Event()

    @property
    def first_failure(self) -> tuple[int, str] | None:
        """``(rank, why)`` of the first failure seen, or None."""
        return self._first

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """Start ranks 1..N-1 (unless the environment did), watch them, run ``function`` as rank 0."""
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if self.cluster_environment.creates_processes_externally:
            set_num_threads_if_needed(self.num_processes)
            return function(*args, **kwargs)
        # Before the children start, so that they inherit OMP_NUM_THREADS: each rank gets its share of
        # the cores (a rank with every core's thread oversubscribes them N times over).
        set_num_threads_if_needed(self.num_processes)
        start_child_ranks(self)
        threading.Thread(target=self._watch, daemon=True, name="lightning_moe-rank-watcher").start()
        try:
            return function(*args, **kwargs)
        except BaseException as err:
            if not _is_sigterm_stop(err):  # a SIGTERM stop ends every rank by itself, after its checkpoint
                self._main_failed(err)
            raise

    # -- failures -------------------------------------------------------------------------------

    def _claim(self, rank: int, why: str) -> bool:
        with self._lock:
            if self._first is not None:
                return False
            self._first = (rank, why)
        _say(f"rank {rank} failed first ({why}); ending every rank this launcher started.")
        return True

    def _failed_child(self, sigterm_too: bool) -> tuple[int, str] | None:
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None and code != 0 and (sigterm_too or code not in _SIGTERM_EXITS):
                return rank, describe_exit(code)
        return None

    def _watch(self) -> None:
        while not self._ended.is_set():
            failed = self._failed_child(sigterm_too=False)
            if failed is not None:
                self._claim(*failed)
                self._end_children()
                if not self._main_stopping.wait(self.grace_s):
                    _say(f"rank 0 did not stop within {self.grace_s:g} s after rank {self._first[0]} failed; "
                         "ending it (exit status 1).")
                    os._exit(1)
                return
            if all(proc.poll() is not None for proc in self.procs):
                return  # every child finished cleanly
            time.sleep(self.poll_s)

    def _main_failed(self, err: BaseException) -> None:
        self._main_stopping.set()
        if self._first is None:
            deadline = time.monotonic() + self.settle_s
            while (failed := self._failed_child(sigterm_too=True)) is None and time.monotonic() < deadline:
                time.sleep(min(self.poll_s, 0.05))
            if failed is not None:
                self._claim(*failed)
            elif self._claim(0, _summary(err)):
                self._end_children_after_exit()
                return
        self._end_children()

    def _ranks(self) -> list[tuple[int, int]]:
        return [(rank, proc.pid) for rank, proc in enumerate(self.procs, start=1) if proc.poll() is None]

    def _end_children_after_exit(self) -> None:
        """Rank 0 failed: a reaper ends the children once this process has exited (see the module docstring)."""
        with self._lock:
            self._ended.set()  # the watcher must not end them first
        ranks = self._ranks()
        if not ranks:
            return
        reaper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py")
        args = [str(os.getpid()), f"{self.grace_s:g}", *(f"{rank}:{pid}" for rank, pid in ranks)]
        try:
            subprocess.Popen([sys.executable, reaper, *args], stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError:  # no reaper: end them now
            self._ended.clear()
            self._end_children()

    def _end_children(self) -> None:
        with self._lock:
            if self._ended.is_set():
                return
            line = end_ranks(self._ranks(), self.grace_s)
            for proc in self.procs:
                proc.poll()  # reap the ended ones
            self._ended.set()
        if line is not None:
            _say(line)
