"""End the ranks of a failed job: SIGTERM (with SIGCONT, for stopped ones), then SIGKILL after a grace.

Used by :mod:`lightning_moe.strategies.launcher` in two ways: called in rank 0's process when a
child failed (:func:`end_ranks`), and, when rank 0 itself failed, run as a separate small process
(``python reaper.py PARENT_PID GRACE_S RANK:PID ...``; standard library only, so it starts in
milliseconds) that waits for rank 0 to exit first: only then do rank 0's connections close, so
the ranks waiting on it fail and report their own error before they are ended.
"""

from __future__ import annotations

import os
import signal
import sys
import time

__all__ = ["end_ranks", "is_alive", "is_stopped", "main"]

_PREFIX = "lightning_moe launcher:"


def _state(pid: int) -> str | None:
    # Linux: the state letter after the command in /proc/<pid>/stat (Z: exited, T/t: stopped).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def is_alive(pid: int) -> bool:
    """True while ``pid`` runs (or is stopped); False once it exited, zombies included."""
    state = _state(pid)
    if state is not None:
        return state != "Z"
    if os.path.isdir("/proc"):
        return False
    try:  # no /proc: ask the kernel (a zombie counts as alive here)
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stopped(pid: int) -> bool:
    """True if ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP) or a tracer."""
    return _state(pid) in ("T", "t")


def _wait_until_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def end_ranks(ranks: list[tuple[int, int]], grace_s: float) -> str | None:
    """End every ``(rank, pid)`` still alive: SIGTERM + SIGCONT, SIGKILL after ``grace_s``.

    Returns one line naming the ranks ended (which were stopped, which needed SIGKILL), or None.
    """
    alive = [(rank, pid) for rank, pid in ranks if is_alive(pid)]
    stopped = {rank for rank, pid in alive if is_stopped(pid)}
    for _, pid in alive:
        for signum in (signal.SIGTERM, signal.SIGCONT):  # a stopped rank acts on SIGTERM once continued
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                break
    _wait_until_gone([pid for _, pid in alive], grace_s)
    killed = set()
    for rank, pid in alive:
        if is_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(rank)
            except ProcessLookupError:
                pass
    if not alive:
        return None
    notes = [f"rank {rank} (pid {pid}{', was stopped' if rank in stopped else ''}"
             f"{f', SIGKILL after {grace_s:g} s' if rank in killed else ''})" for rank, pid in alive]
    return "ended " + ", ".join(notes) + "."


def main(argv: list[str]) -> None:
    """``PARENT_PID GRACE_S RANK:PID ...``: once the parent exited (or after ``2 * GRACE_S``), give
    the ranks ``GRACE_S`` to stop by themselves, then end them (:func:`end_ranks`)."""
    parent, grace_s = int(argv[0]), float(argv[1])
    ranks = [(int(rank), int(pid)) for rank, pid in (item.split(":") for item in argv[2:])]
    deadline = time.monotonic() + 2 * grace_s
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.05)
    _wait_until_gone([pid for _, pid in ranks], grace_s)
    line = end_ranks(ranks, grace_s)
    if line is not None:
        print(f"{_PREFIX} {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
