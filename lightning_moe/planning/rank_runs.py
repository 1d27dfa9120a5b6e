"""Run the planned ranks' fake steps, several at once in forked processes.

Each planned rank (the first of each pipeline stage) runs a whole ``Trainer.fit`` on fake tensors,
which costs its own CPU core for a minute or more on a large model; the ranks need nothing from
each other but the objects a pipeline stage broadcasts (`FakeObjects`: stage 0's boundary shapes,
the last stage's). So they run in ``jobs`` forked processes at a time. A worker hands each object
to this process as it sends it, and one that needs an object waits for it: stage 0 and the last
stage, which need each other's, run side by side. Where every running worker waits for an object
none of them sends, they stop (`AwaitsObject`) and run again once a rank has sent theirs, with
everything sent so far. ``jobs=1`` runs them one after another in this process.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import signal
import traceback
from collections.abc import Callable, Hashable, Sequence
from multiprocessing.connection import wait

from lightning_moe.planning.fake_objects import AwaitsObject, FakeObjects
from lightning_moe.planning.plan_config import PlanConfigError

__all__ = ["default_jobs", "run_ranks"]

_PR_SET_PDEATHSIG = 1  # prctl(2)

RunRank = Callable[[Hashable, FakeObjects], object]
"""``run(key, objects)``: a run's fake step (``key`` names it: a rank, or a rank and what it runs),
receiving from and sending to ``objects``."""


def default_jobs(num_ranks: int) -> int:
    """As many processes as the CPUs this process may use, at most one per planned rank."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, num_ranks))


def run_ranks(ranks: Sequence[Hashable], run: RunRank, jobs: int, sent: dict | None = None) -> dict[Hashable, object]:
    """``{key: run(key, objects)}`` for every key in ``ranks`` (in that order of preference).

    ``sent``: the objects earlier runs sent (`FakeObjects.sent`), updated with this call's. Raises `PlanConfigError` when the remaining ranks only wait for each other's objects, and the
    first error a rank raised otherwise (a worker's error with its traceback in the message).
    """
    sent = {} if sent is None else sent
    if jobs <= 1 or len(ranks) <= 1:
        return _one_by_one(ranks, run, sent)
    return _forked(ranks, run, jobs, sent)


def _one_by_one(ranks: Sequence[Hashable], run: RunRank, sent: dict) -> dict[Hashable, object]:
    objects, done, pending = FakeObjects(), {}, list(ranks)
    objects.sent = sent
    while pending:
        waiting = []
        for rank in pending:
            try:
                done[rank] = run(rank, objects)
            except AwaitsObject:
                waiting.append(rank)
        if waiting and len(waiting) == len(pending):
            raise PlanConfigError(f"the ranks {waiting} wait for each other's objects; cannot plan.")
        pending = waiting
    return done


def _forked(ranks: Sequence[Hashable], run: RunRank, jobs: int, sent: dict) -> dict[Hashable, object]:
    context = multiprocessing.get_context("fork")
    done: dict[Hashable, object] = {}
    # rank -> (the key of the object its last run waited for, how many objects that run started with)
    awaited: dict[Hashable, tuple[object, int]] = {}
    running: dict = {}  # connection -> (rank, process, how many objects it started with)
    blocked: dict = {}  # connection -> the key of the object its worker waits for now

    def ready(rank: Hashable) -> bool:
        if rank not in awaited:
            return True
        key, started_with = awaited[rank]
        return key in sent if key is not None else len(sent) > started_with

    def answer_blocked() -> None:
        for connection, key in list(blocked.items()):
            if key in sent:
                connection.send(("object", sent[key]))
                del blocked[connection]

    try:
        while len(done) < len(ranks):
            for rank in ranks:
                if len(running) >= jobs:
                    break
                busy = any(r == rank for r, _, _ in running.values())
                if rank in done or busy or not ready(rank):
                    continue
                connection, child_end = context.Pipe()
                process = context.Process(target=_child, args=(run, rank, dict(sent), child_end), daemon=True)
                process.start()
                child_end.close()
                running[connection] = (rank, process, len(sent))
            if not running:
                waiting = [r for r in ranks if r not in done]
                raise PlanConfigError(f"the ranks {waiting} wait for each other's objects; cannot plan.")
            if len(blocked) == len(running):
                # Every worker waits for an object none of them will send: they stop and run again
                # once a rank planned after them has sent it (their slots go to those ranks).
                for connection in blocked:
                    connection.send(("stop", None))
                blocked.clear()
            for connection in wait(list(running)):
                rank, process, started_with = running[connection]
                message = _receive(connection, rank)
                if message[0] == "sent":  # an object, as the worker sends it
                    sent[message[1]] = message[2]
                elif message[0] == "awaits_now":  # the worker waits for it
                    blocked[connection] = message[1]
                else:
                    outcome, value, objects = message
                    del running[connection]
                    blocked.pop(connection, None)
                    connection.close()
                    process.join()
                    sent.update(objects)
                    if outcome == "done":
                        done[rank] = value
                    elif outcome == "awaits":
                        awaited[rank] = (value, started_with)
                    else:
                        raise value
                answer_blocked()
    finally:
        for connection, (_, process, _) in running.items():
            process.kill()
            process.join()
            connection.close()
    return done


def _die_with_parent() -> None:
    """Linux: this process is killed when the planner's process dies (a SIGTERM or SIGKILL to it
    would otherwise leave the workers planning on)."""
    # Elsewhere there is no libc.so.6: the parent's finally-block still stops them on errors and Ctrl-C.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _child(run: RunRank, rank: Hashable, sent: dict, connection) -> None:
    _die_with_parent()

    def fetch(key):
        connection.send(("awaits_now", key))
        answer, value = connection.recv()
        return value if answer == "object" else None

    objects = FakeObjects(publish=lambda key, value: connection.send(("sent", key, value)), fetch=fetch)
    objects.sent = sent
    try:
        outcome, value = "done", run(rank, objects)
    except AwaitsObject as error:
        outcome, value = "awaits", error.key
    except BaseException as error:  # every failure goes back to the parent, which raises it
        outcome, value = "error", _portable(error)
    connection.send((outcome, value, objects.sent))
    connection.close()


def _portable(error: BaseException) -> BaseException:
    """``error`` if it pickles, else a RuntimeError with its traceback."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # any pickling failure
        text = "".join(traceback.format_exception(error))
        return RuntimeError(f"planning a rank failed in a worker process:\n{text}")


def _receive(connection, rank: Hashable) -> tuple:
    try:
        return connection.recv()
    except EOFError:
        raise RuntimeError(
            f"the process planning rank {rank} died without an answer (out of memory? run with --jobs 1 to see "
            "its error here)."
        ) from None
