"""Bytes one rank sends for one collective, as the ring and pairwise algorithms of NCCL and gloo move them.

A collective's buffer is not what crosses the wire: an all-reduce of ``N`` bytes over ``n`` ranks
sends ``2 (n - 1) / n * N`` from each rank (reduce-scatter, then all-gather, around a ring), an
all-gather sends this rank's shard to the ``n - 1`` others, and an all-to-all keeps the rows it
addresses to itself. With ``C`` the bytes this rank contributes (the op's ``input``/``inputs``
argument, or the ``tensors`` of the in-place ops that have no separate input):

===============  ==============================================================
all_reduce       ``2 (n - 1) / n * C``
all_gather       ``(n - 1) * C`` (``C`` is the shard; the gathered buffer is ``n * C``)
reduce_scatter   ``(n - 1) / n * C`` (``C`` is the whole buffer; this rank keeps ``C / n``)
all_to_all       ``C`` less the rows addressed to this rank (its entry of the input split
                 sizes; ``C / n`` without them)
broadcast        ``(n - 1) / n * C`` (a pipelined ring's average: every rank but one forwards)
send             ``C``
recv             ``0`` (this rank sends nothing)
===============  ==============================================================

A group of one rank sends nothing. The bytes are what leaves the rank, whatever link carries them
(NVLink within a node, the network across nodes).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["sent_bytes"]


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _contributed(name: str, kind: str, args: tuple) -> Any:
    """What this rank puts in: the second argument of torch.distributed's in-place ops that take an
    output first (``c10d._allgather_base_(output, input, ...)``), else the first (the functional
    ops' ``input``, the ``tensors`` of ``c10d.allreduce_``/``broadcast_``/``send``)."""
    output_first = name.startswith("c10d.") and kind in ("all_to_all", "all_gather", "reduce_scatter")
    return args[1 if output_first else 0]


def _input_splits(name: str, args: tuple) -> list[int]:
    """An all-to-all's input split sizes (rows per destination; empty: equal shares)."""
    index = {"c10d.alltoall_base_": 4, "_c10d_functional.all_to_all_single": 2}.get(name)
    return [] if index is None or len(args) <= index else list(args[index] or [])


def _kept_by_all_to_all(contributed: Any, splits: list[int], index: int, n: int) -> int:
    """Bytes of an all-to-all's input that this rank (``index`` in its group) addresses to itself."""
    if isinstance(contributed, (list, tuple)):  # c10d.alltoall_: one input tensor per destination
        return _tensor_bytes(contributed[index])
    total = _tensor_bytes(contributed)
    if not splits or contributed.shape[0] == 0:
        return total // n
    return total // contributed.shape[0] * int(splits[index])


def sent_bytes(kind: str, name: str, args: tuple, ranks: tuple[int, ...], rank: int) -> int:
    """Bytes ``rank`` sends for the collective op called ``name`` (``"c10d._allgather_base_"``,
    ``"_c10d_functional.all_reduce"``, ...; of kind ``kind``, see
    `lightning_moe.planning.step_probe.Collective`) with positional ``args`` over the group ``ranks``."""
    n = len(ranks)
    if n <= 1 or kind == "recv":
        return 0
    contributed = _contributed(name, kind, args)
    c = _tensor_bytes(contributed)
    if kind == "all_reduce":
        return 2 * (n - 1) * c // n
    if kind == "all_gather":
        return (n - 1) * c
    if kind in ("reduce_scatter", "broadcast"):
        return (n - 1) * c // n
    if kind == "all_to_all":
        return c - _kept_by_all_to_all(contributed, _input_splits(name, args), ranks.index(rank), n)
    if kind == "send":
        return c
    raise AssertionError(f"no wire-bytes rule for collective kind {kind!r}")
