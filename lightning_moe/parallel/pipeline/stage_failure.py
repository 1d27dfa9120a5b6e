"""When one pipeline stage fails, every rank of the pipeline says which stage failed and why.

A stage that raises (its loss, a layer, memory) ends its process; the ranks of the other stages
wait on it in a send, a receive or the loss broadcast, and all they see is the transport's error
(gloo: "Connection closed by peer") or a timeout, with nothing about the cause. So the pipeline
(:class:`~lightning_moe.parallel.pipeline.runner.PipelineRunner`) catches what a step raises:

* a rank whose own stage raised writes one line to the default process group's store,
  ``"pipeline stage 1 (rank 1) failed: ValueError: ..."``, before it re-raises its error (with a
  note naming its stage);
* a rank whose step failed otherwise (its exchange broke) reads its pipeline peers' lines, waiting
  up to ``wait_s`` for one, and raises :class:`PipelineStageError` with that line and its own error.
  Without a line (a peer killed, out of memory, stopped) it says so and names the peers.

The store is served by global rank 0: if rank 0 itself is the stage that failed and its process
ends at once, its peers cannot read the line and say that the exchange failed; the launcher
names the rank that failed first (:mod:`lightning_moe.strategies.launcher`).
"""

from __future__ import annotations

import contextlib
import time

import torch.distributed as dist

from lightning_moe.compat import default_store

__all__ = ["PipelineStageError", "describe_peer_failure", "looks_like_transport_error", "publish_failure"]

_KEY = "lightning_moe/pipeline_failure/{rank}"
# Messages of a broken exchange (rather than a failure of this rank's own computation).
_TRANSPORT_MARKERS = ("connection closed", "connection reset", "timed out", "timeout", "gloo", "nccl", "broken pipe")


class PipelineStageError(RuntimeError):
    """Raised on a pipeline rank whose step stopped because another stage failed (or vanished)."""


def _store():
    try:
        return default_store()
    except Exception:  # no default group, or it was destroyed
        return None


def _summary(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return type(err).__name__ + (f": {lines[0][:500]}" if lines else "")


def looks_like_transport_error(err: BaseException) -> bool:
    """True for a failed exchange (a ``DistError``, or gloo / NCCL / socket wording), not a computation error."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(marker in text for marker in _TRANSPORT_MARKERS)


def publish_failure(err: BaseException, stages: list[int], rank: int) -> None:
    """Tell the other stages that this rank's stage(s) raised ``err`` (best effort) and add a note to ``err``."""
    where = f"pipeline stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))} (rank {rank})"
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):  # the store is gone: the peers will say the exchange failed
            store.set(_KEY.format(rank=rank), f"{where} failed: {_summary(err)}")
    err.add_note(f"raised in {where}; the other pipeline stages stop too")


def _peer_line(peers: list[int]) -> str | None:
    store = _store()
    if store is None:
        return None
    for peer in peers:
        key = _KEY.format(rank=peer)
        try:
            if store.check([key]):
                return store.get(key).decode()
        except Exception:
            return None  # the store's server (rank 0) is gone
    return None


def describe_peer_failure(err: BaseException, stages: list[int], rank: int, peers: list[int],
                          wait_s: float = 2.0) -> PipelineStageError | None:
    """The error to raise on this rank when another stage caused ``err``, or None when ``err`` is this rank's own.

    ``peers``: the global ranks of this rank's pipeline group, itself excluded.
    """
    transport = looks_like_transport_error(err)
    deadline = time.monotonic() + (wait_s if transport else 0.0)
    while True:
        line = _peer_line(peers)
        if line is not None or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    here = f"this rank (pipeline stage {', '.join(map(str, stages))}, rank {rank})"
    if line is not None:
        return PipelineStageError(f"{line}; {here} stopped because of it ({_summary(err)})")
    if transport:
        return PipelineStageError(
            f"{here} lost an exchange with another rank ({_summary(err)}), and no other pipeline stage (ranks "
            f"{peers}) reported an error: a rank it exchanges with stopped, was killed or ran out of memory; "
            "see the log of the rank that failed first."
        )
    return None
