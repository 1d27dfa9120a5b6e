"""Per-dispatcher accounting of what crossed the wire, readable by metrics and benchmarks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DispatchStats"]


@dataclass
class DispatchStats:
    """Counters a dispatcher adds to on every forward dispatch/combine; read and reset by consumers.

    Bytes count only what leaves this rank for another rank (rows a rank keeps for itself are not
    sent), forward direction only: the backward moves the same amounts in reverse. Host integers,
    known without a device synchronisation (the split sizes are on the host already).
    ``tokens_dropped`` is a device tensor (capacity dropping), counted once per micro-batch.

    Payload (``dispatch_bytes``, ``combine_bytes``) is what the experts consume: token rows,
    probabilities, expert outputs. Routing indices that travel beside it in a collective of their
    own (the ``flex`` dispatcher's per-row expert bitmasks) are ``dispatch_index_bytes``; the
    split sizes exchanged before a dispatch are counted nowhere. ``allgather`` gathers the whole
    routing map with the tokens and counts it in ``dispatch_bytes``.
    """

    dispatch_bytes: int = 0
    """Payload bytes this rank sent while dispatching (token rows and their probabilities)."""
    combine_bytes: int = 0
    """Payload bytes this rank sent while combining (expert output rows)."""
    dispatch_bytes_received: int = 0
    """Payload bytes this rank received from other ranks while dispatching."""
    combine_bytes_received: int = 0
    """Payload bytes this rank received from other ranks while combining."""
    dispatch_index_bytes: int = 0
    """Routing-index bytes this rank sent while dispatching, beside the payload (``flex``: the
    bitmask of the destination's local experts of every token row)."""
    dispatch_index_bytes_received: int = 0
    """Routing-index bytes this rank received from other ranks while dispatching."""
    rows_sent: int = 0
    """Token rows this rank sent to other ranks while dispatching (``alltoall``: one per remote
    (token, expert) pair; ``flex``: one per (token, remote EP rank) pair)."""
    dispatches: int = 0
    """Forward dispatches counted."""
    tokens_dropped: Tensor | None = None
    """(token, expert) assignments dropped by the capacity limit (device tensor), or None."""

    def add_dropped(self, dropped: Tensor) -> None:
        """Accumulate dropped assignments without a host read."""
        dropped = dropped.detach().to(torch.int64)
        self.tokens_dropped = dropped if self.tokens_dropped is None else self.tokens_dropped + dropped

    def reset(self) -> DispatchStats:
        """Return a copy of the counters and zero them."""
        snapshot = dataclasses.replace(self)
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)
        return snapshot
