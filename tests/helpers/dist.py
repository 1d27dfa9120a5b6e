"""Run a function on several gloo ranks, each in a forked process, and collect what each returns.

Usage (inside a test)::

    from helpers.dist import run_distributed

    def _check_all_reduce(rank, world_size, scale):
        t = torch.tensor([float(rank) * scale])
        torch.distributed.all_reduce(t)
        return t.item()

    def test_all_reduce(tmp_path):
        assert run_distributed(_check_all_reduce, 4, 2.0, tmp_dir=tmp_path) == [12.0] * 4

Each rank joins a process group whose rendezvous is a ``FileStore`` under ``tmp_dir``, runs
``fn(rank, world_size, *args)`` with one intra-op thread, and pickles its return value back to the
parent. Results come back as a list in rank order. If any rank raises, hangs past ``timeout_s`` or
dies without reporting, the parent raises one :class:`DistributedTestError` naming every such rank
(with the full traceback of each rank that raised). No child outlives the call.

``fork`` is used because it starts a rank in milliseconds (``spawn`` re-imports torch, 5-18 s per
rank), and it lets ``fn`` be a local closure. ``fn`` must therefore not rely on CUDA state created
in the parent.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_moe.planning.fake_world import forget_dtensor_layouts

__all__ = ["DistributedTestError", "forget_dtensor_layouts", "run_distributed"]

# Once one rank has failed, its peers are usually stuck in a collective that will never complete;
# give them this long to report their own error before killing them, instead of the full timeout.
_PEER_GRACE_AFTER_FAILURE_S = 5.0
# How long a rank gets to exit after SIGTERM before SIGKILL.
_TERMINATE_GRACE_S = 1.0


class DistributedTestError(AssertionError):
    """One or more ranks of :func:`run_distributed` raised, hung or died; the message says which."""


def _rank_main(fn, rank, world_size, args, backend, store_path, timeout_s, conn) -> None:
    """Body of a forked rank: run ``fn`` inside a process group and send back (ok, value or traceback)."""
    try:
        torch.set_num_threads(1)  # ranks share the machine's few cores
        forget_dtensor_layouts()  # layouts the parent cached (a fake rank it played) name its meshes
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # Every rank finishes connecting before any runs fn: a rank that returned (and exited)
        # at once could otherwise close its sockets while a peer is still connecting to it.
        dist.barrier()
        payload = pickle.dumps((True, fn(rank, world_size, *args)))
    except BaseException:
        payload = pickle.dumps((False, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()
    try:
        # Plain pickle (not the Connection's ForkingPickler) copies tensor data into the message;
        # torch's shared-memory reductions would need this process alive after it exits.
        conn.send_bytes(payload)
        conn.close()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        # Skip the inherited interpreter teardown (pytest's atexit hooks, multiprocessing's finalizers).
        os._exit(0)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"was killed by signal {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _receive(conn, process) -> tuple[str, Any]:
    """Read one rank's report from its pipe, or describe how it died if the pipe closed empty."""
    try:
        ok, value = pickle.loads(conn.recv_bytes())
    except EOFError:
        process.join()
        return "died", f"{_describe_exit(process.exitcode)} without reporting a result"
    except Exception:
        return "raised", "its result could not be unpickled in the parent:\n" + traceback.format_exc()
    return ("ok" if ok else "raised"), value


def _stop(process) -> None:
    """SIGTERM, then SIGKILL if still alive after a grace period; always reaps the process."""
    if process.is_alive():
        process.terminate()
        process.join(_TERMINATE_GRACE_S)
    if process.is_alive():
        process.kill()
    process.join()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    tmp_dir: str | os.PathLike | None = None,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks; return the results in rank order.

    ``fn`` need not be picklable (the forked ranks inherit it); its return value must be.
    ``tmp_dir`` holds the file-store rendezvous (pass pytest's ``tmp_path``); by default a temporary
    directory is created and removed. Raises :class:`DistributedTestError` if any rank raises, is
    still running after ``timeout_s`` seconds (it is killed), or exits without reporting a result.
    """
    owned_dir = tempfile.mkdtemp(prefix="run_distributed-") if tmp_dir is None else None
    # A fresh file per launch: a test may call run_distributed several times with one tmp_path.
    store_path = os.path.join(owned_dir or os.fspath(tmp_dir), f"filestore-{uuid.uuid4().hex}")
    ctx = multiprocessing.get_context("fork")
    processes, conns = [], []
    outcomes: dict[int, tuple[str, Any]] = {}  # rank -> ("ok", value) | ("raised", tb) | ("died", why)
    first_failure = None
    try:
        for rank in range(world_size):
            recv_conn, send_conn = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, args, backend, store_path, timeout_s, send_conn),
                name=f"run_distributed-rank{rank}",
            )
            process.start()
            # Close the parent's copy of the write end (before the next fork) so a rank that dies
            # makes its pipe readable as EOF instead of leaving us waiting.
            send_conn.close()
            processes.append(process)
            conns.append(recv_conn)

        deadline = time.monotonic() + timeout_s
        while len(outcomes) < world_size and (remaining := deadline - time.monotonic()) > 0:
            pending = [conns[r] for r in range(world_size) if r not in outcomes]
            # Waiting on the pipes (not join()) means a large result can never fill the pipe and
            # block the child while we wait for it to exit.
            for conn in multiprocessing.connection.wait(pending, timeout=remaining):
                rank = conns.index(conn)
                outcomes[rank] = _receive(conn, processes[rank])
                if outcomes[rank][0] != "ok" and first_failure is None:
                    first_failure = rank
                    deadline = min(deadline, time.monotonic() + _PEER_GRACE_AFTER_FAILURE_S)
    finally:
        for process in processes:
            _stop(process)
        for conn in conns:
            conn.close()
        if owned_dir is not None:
            shutil.rmtree(owned_dir, ignore_errors=True)

    failures = []
    for rank in range(world_size):
        kind, detail = outcomes.get(rank, ("hung", None))
        if kind == "hung":
            when = (
                f"{_PEER_GRACE_AFTER_FAILURE_S} s after rank {first_failure} failed"
                if first_failure is not None
                else f"after the {timeout_s} s timeout"
            )
            failures.append(f"rank {rank} hung: still running {when}; killed")
        elif kind == "died":
            failures.append(f"rank {rank} {detail}")
        elif kind == "raised":
            failures.append(f"rank {rank} raised:\n{detail}")
    if failures:
        name = getattr(fn, "__qualname__", repr(fn))
        header = f"run_distributed({name}, world_size={world_size}) failed on {len(failures)} rank(s)" + (
            f" (rank {first_failure} failed first)" if first_failure is not None else ""
        )
        raise DistributedTestError(header + ":\n\n" + "\n\n".join(failures))
    return [outcomes[rank][1] for rank in range(world_size)]
