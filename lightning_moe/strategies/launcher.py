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
* then every rank it started that still runs is ended: SIGTERM (with SIGCONT, so that a stopped
  rank receives it), SIGKILL after ``grace_s``; the message names the ranks that were stopped and
  those that had to be killed. On a rank-0 failure its gloo connections are closed first (the store
  stays up), so that the ranks waiting on it fail at once and report their own error (e.g. which
  pipeline stage failed, :mod:`lightning_moe.parallel.stage_failure`) instead of dying silently;
* when a child failed and rank 0 does not stop by itself within ``grace_s`` after the others were
  ended (it may wait in a collective that never completes), rank 0 exits with status 1.

A launch by torchrun, SLURM or an existing process group starts no process here, so this does
nothing then: that launcher owns the processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.exceptions import SIGTERMException

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


def _is_stopped(pid: int) -> bool:
    # Linux: the state letter after the command in /proc/<pid>/stat; "T" = stopped by a signal.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _is_sigterm_stop(err: BaseException) -> bool:
    if isinstance(err, SIGTERMException):
        return True
    return isinstance(err, SystemExit) and err.code in (None, 0, *_SIGTERM_EXITS)


def _say(message: str) -> None:
    print(f"{_PREFIX} {message}", file=sys.stderr, flush=True)


def _close_connections(timeout_s: float) -> None:
    """Close this process's gloo connections (keep the store: peers may read from it); bounded
    in time, since a destroy could wait on work that its peers never complete."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "gloo":
        return  # NCCL's teardown can hang while peers wait in a kernel: SIGTERM/SIGKILL end them
    store = dist.distributed_c10d._get_default_store()  # rank 0 serves the TCPStore: keep it alive
    worker = threading.Thread(target=dist.destroy_process_group, daemon=True, name="lightning_moe-close-pg")
    worker.start()
    worker.join(timeout_s)
    _close_connections.kept_store = store  # type: ignore[attr-defined]


class MoESubprocessLauncher(_SubprocessScriptLauncher):
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
            _set_num_threads_if_needed(num_processes=self.num_processes)
            return function(*args, **kwargs)
        self._call_children_scripts()
        threading.Thread(target=self._watch, daemon=True, name="lightning_moe-rank-watcher").start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
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
            elif self._claim(0, f"{type(err).__name__}: {err}".splitlines()[0][:300]):
                _close_connections(self.grace_s)
        self._end_children()

    def _end_children(self) -> None:
        with self._lock:
            if self._ended.is_set():
                return
            alive = [(rank, proc) for rank, proc in enumerate(self.procs, start=1) if proc.poll() is None]
            stopped = [rank for rank, proc in alive if _is_stopped(proc.pid)]
            for _, proc in alive:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                    proc.send_signal(signal.SIGCONT)  # a stopped rank acts on SIGTERM only once continued
            deadline = time.monotonic() + self.grace_s
            while any(proc.poll() is None for _, proc in alive) and time.monotonic() < deadline:
                time.sleep(0.05)
            killed = [rank for rank, proc in alive if proc.poll() is None]
            for _, proc in alive:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    proc.wait()
            self._ended.set()
        if alive:
            notes = [f"rank {r} (pid {p.pid}{', was stopped' if r in stopped else ''}"
                     f"{f', SIGKILL after {self.grace_s:g} s' if r in killed else ''})" for r, p in alive]
            _say("ended " + ", ".join(notes) + ".")
