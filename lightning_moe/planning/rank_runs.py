"""Run the planned ranks' fake steps, several at once in forked processes.

Each planned rank (the first of each pipeline stage) runs a whole ``Trainer.fit`` on fake tensors,
which costs its own CPU core for a minute or more on a large model; the ranks need nothing from
each other but the objects a pipeline stage broadcasts (`FakeObjects`: stage 0's boundary shapes,
the last stage's). So they run in ``jobs`` forked worker processes, each taking one run after
another: a worker's later runs find the fake tensors' cache warm (the output shapes of the
operators its earlier runs ran: a second or more of each run). A finished run can ask for more
(``then``: the middle stages' runs, known once stage 0's has run), which start as soon as a worker
is free. A worker hands each object to this process as it sends it, and one that needs an object
waits for it: stage 0 and the last stage, which need each other's, run side by side. Where every
running worker waits for an object none of them sends, they stop (`AwaitsObject`) and run again
once a rank has sent theirs, with everything sent so far. ``jobs=1`` runs them one after another
in this process.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import signal
import traceback
from collections.abc import Callable, Hashable, Iterable, Sequence
from multiprocessing.connection import wait

from lightning_moe.planning.fake_objects import AwaitsObject, FakeObjects
from lightning_moe.planning.plan_config import PlanConfigError

__all__ = ["default_jobs", "run_ranks"]

_PR_SET_PDEATHSIG = 1  # prctl(2)

RunRank = Callable[[Hashable, FakeObjects], object]
"""``run(key, objects)``: a run's fake step (``key`` names it: a rank, or a rank and what it runs),
receiving from and sending to ``objects``."""

Then = Callable[[Hashable, object], Iterable[Hashable]]
"""``then(key, result)``: the keys to run once ``key``'s run has given ``result``."""


def default_jobs(num_ranks: int) -> int:
    """As many processes as the CPUs this process may use, at most one per planned rank."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, num_ranks))


def run_ranks(ranks: Sequence[Hashable], run: RunRank, jobs: int, sent: dict | None = None,
              then: Then | None = None) -> dict[Hashable, object]:
    """``{key: run(key, objects)}`` for every key in ``ranks`` (in that order of preference) and every
    key ``then`` adds.

    ``sent``: the objects earlier runs sent (`FakeObjects.sent`), updated with this call's.
    ``then(key, result)``: called here as each run finishes; returns the keys to run next (those
    that need its result), queued after the others. Raises `PlanConfigError` when the remaining
    ranks only wait for each other's objects, and the first error a rank raised otherwise (a
    worker's error with its traceback in the message).
    """
    sent = {} if sent is None else sent
    if jobs <= 1 or (len(ranks) <= 1 and then is None):
        return _one_by_one(ranks, run, sent, then)
    return _forked(ranks, run, jobs, sent, then)


def _one_by_one(ranks: Sequence[Hashable], run: RunRank, sent: dict, then: Then | None) -> dict[Hashable, object]:
    objects, done, pending = FakeObjects(), {}, list(ranks)
    objects.sent = sent
    while pending:
        waiting = []
        for key in pending:  # grows as runs finish: `then` queues what needs them
            try:
                done[key] = run(key, objects)
            except AwaitsObject:
                waiting.append(key)
                continue
            if then is not None:
                pending.extend(k for k in then(key, done[key]) if k not in pending)
        if waiting and len(waiting) == len(pending):
            raise PlanConfigError(f"the ranks {waiting} wait for each other's objects; cannot plan.")
        pending = waiting
    return done


def _forked(ranks: Sequence[Hashable], run: RunRank, jobs: int, sent: dict, then: Then | None) -> dict[Hashable, object]:
    context = multiprocessing.get_context("fork")
    queue, done = list(ranks), {}
    # key -> (the key of the object its last run waited for, how many objects that run started with)
    awaited: dict[Hashable, tuple[object, int]] = {}
    workers: dict = {}  # connection -> process, every worker forked so far
    idle: list = []  # the connections of workers waiting for their next run
    running: dict = {}  # connection -> (key, how many objects it started with)
    blocked: dict = {}  # connection -> the key of the object its worker waits for now

    def ready(key: Hashable) -> bool:
        if key not in awaited:
            return True
        awaits, started_with = awaited[key]
        return awaits in sent if awaits is not None else len(sent) > started_with

    def answer_blocked() -> None:
        for connection, key in list(blocked.items()):
            if key in sent:
                connection.send(("object", sent[key]))
                del blocked[connection]

    try:
        while len(done) < len(queue):
            for key in queue:
                if len(running) >= jobs:
                    break
                busy = any(k == key for k, _ in running.values())
                if key in done or busy or not ready(key):
                    continue
                connection = idle.pop() if idle else _start_worker(context, run, workers)
                connection.send(("run", key, dict(sent)))
                running[connection] = (key, len(sent))
            if not running:
                waiting = [k for k in queue if k not in done]
                raise PlanConfigError(f"the ranks {waiting} wait for each other's objects; cannot plan.")
            if len(blocked) == len(running):
                # Every worker waits for an object none of them will send: they stop and run again
                # once a rank planned after them has sent it (their slots go to those ranks).
                for connection in blocked:
                    connection.send(("stop", None))
                blocked.clear()
            for connection in wait(list(running)):
                key, started_with = running[connection]
                message = _receive(connection, key)
                if message[0] == "sent":  # an object, as the worker sends it
                    sent[message[1]] = message[2]
                elif message[0] == "awaits_now":  # the worker waits for it
                    blocked[connection] = message[1]
                else:
                    outcome, value, objects = message
                    del running[connection]
                    blocked.pop(connection, None)
                    idle.append(connection)
                    sent.update(objects)
                    if outcome == "done":
                        done[key] = value
                        if then is not None:
                            queue.extend(k for k in then(key, value) if k not in queue)
                    elif outcome == "awaits":
                        awaited[key] = (value, started_with)
                    else:
                        raise value
                answer_blocked()
    finally:
        for connection, process in workers.items():
            if connection in idle:
                with contextlib.suppress(OSError):
                    connection.send(("exit", None))
            else:
                process.kill()
            process.join()
            connection.close()
    return done


def _start_worker(context, run: RunRank, workers: dict):
    """Fork a worker for runs of ``run``; returns the connection to it (added to ``workers``)."""
    connection, child_end = context.Pipe()
    process = context.Process(target=_worker, args=(run, child_end), daemon=True)
    process.start()
    child_end.close()
    workers[connection] = process
    return connection


def _die_with_parent() -> None:
    """Linux: this process is killed when the planner's process dies (a SIGTERM or SIGKILL to it
    would otherwise leave the workers planning on)."""
    # Elsewhere there is no libc.so.6: the parent's finally-block still stops them on errors and Ctrl-C.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _worker(run: RunRank, connection) -> None:
    """Run what the planner sends (``("run", key, objects sent so far)``) until it says ``exit``:
    one process runs one key after another, and what it has warmed up (the fake tensors' cache of
    the operators' output shapes) serves the next."""
    _die_with_parent()

    def fetch(key):
        connection.send(("awaits_now", key))
        answer, value = connection.recv()
        return value if answer == "object" else None

    while True:
        try:
            order, *task = connection.recv()
        except EOFError:  # the planner has gone
            break
        if order != "run":
            break
        key, sent = task
        objects = FakeObjects(publish=lambda key, value: connection.send(("sent", key, value)), fetch=fetch)
        objects.sent = sent
        try:
            outcome, value = "done", run(key, objects)
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
