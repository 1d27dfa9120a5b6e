"""Check that the ranks of a group (tensor parallelism) hold the same batch.

Tensor-parallel ranks split every sequence of their batch between them, so they must load the
same samples: the sampler gives them the same indices (``distributed_sampler_kwargs`` counts data
-parallel replicas only), but anything random in the loading pipeline that is seeded per rank
(``seed_everything(workers=True)`` seeds data-loader workers from the *global* rank; random
cropping, masking or shuffling buffers) silently gives each TP rank different data, and the
model then trains on sequences stitched together from different samples. Megatron broadcasts
every batch from TP rank 0; we check instead, and name the cause.

The check is one ``all_gather`` of a fixed-size fingerprint per batch (4 float64 numbers: the
number of tensors, their total size, a hash of their shapes and dtypes, and a position-weighted
checksum of their bits), compared on the device. :func:`check_same_batch` reads the comparison at
once; :class:`BatchAgreement` keeps it on the device across the micro-batches of gradient
accumulation and reads it once per optimizer step (a host read stalls the launch queue of a GPU).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_moe.compat import tree_flatten

__all__ = ["BatchAgreement", "batch_fingerprint", "check_same_batch"]

_WEIGHT_PERIOD = 8191  # a prime: positions weigh 1..8191, so swapped elements change the checksum
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: Tensor) -> Tensor:
    """The tensor's elements as integers of the same width (bit patterns: -0.0 != 0.0, NaN == NaN)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.to(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.is_floating_point():
        return flat.view(_INT_VIEW[flat.element_size()])
    return flat


def batch_fingerprint(batch: Any, device: torch.device | None = None) -> Tensor:
    """A float64 ``[4]`` summary of every tensor in ``batch`` (any nesting of containers), on ``device``.

    Equal batches give equal fingerprints; different ones almost surely differ (a checksum, not
    a cryptographic hash). Non-tensor leaves are ignored. ``device`` defaults to the device of the
    batch's first tensor (the CPU without any).
    """
    tensors = [leaf for leaf in tree_flatten(batch)[0] if isinstance(leaf, Tensor)]
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    total = torch.zeros(4, dtype=torch.float64, device=device)
    total[0] = len(tensors)
    for index, tensor in enumerate(tensors):
        # crc32, not hash(): str hashes differ between processes (PYTHONHASHSEED).
        layout = zlib.crc32(f"{index}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        total[1] += tensor.numel()
        total[2] += layout
        bits = _bits(tensor).to(device=device, dtype=torch.float64)
        weights = torch.arange(bits.numel(), device=device, dtype=torch.float64).remainder_(_WEIGHT_PERIOD).add_(1)
        total[3] += (bits * weights).sum()
    return total


def _disagreement(batch: Any, group: dist.ProcessGroup) -> Tensor:
    """Collective over ``group``: a bool ``[size]`` tensor on the batch's device, true where a rank's
    fingerprint differs from the first rank's. No host read."""
    mine = batch_fingerprint(batch)
    pieces = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, mine, group=group)
    every = torch.stack(pieces)
    return (every != every[0]).any(dim=1)


def _raise_if_disagree(disagree: Tensor, group: dist.ProcessGroup, what: str) -> None:
    if bool(disagree.any()):  # the one host read
        members = dist.get_process_group_ranks(group)
        odd = [members[i] for i in torch.nonzero(disagree).flatten().tolist()]
        raise ValueError(
            f"The ranks of {what} group {members} received different batches (global ranks {odd} differ "
            f"from rank {members[0]}). These ranks split each sample between them and must load identical "
            "batches. Look for randomness in the data pipeline that depends on the rank: data-loader workers "
            "seeded per rank (seed_everything(workers=True) uses the global rank) with random augmentation or "
            "masking, per-rank shuffle buffers, or a sampler that ignores strategy.distributed_sampler_kwargs. "
            "Draw such randomness from a seed shared by the group (e.g. derived from the data-parallel rank)."
        )


def check_same_batch(batch: Any, group: dist.ProcessGroup, what: str = "tensor-parallel") -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all of them hold the same ``batch``.

    Collective over ``group`` (every member must call it with its batch), with one host read; a
    no-op for a group of one. The fingerprints live on the device of the batch's first tensor (or
    the CPU).
    """
    if dist.get_world_size(group) == 1:
        return
    _raise_if_disagree(_disagreement(batch, group), group, what)


class BatchAgreement:
    """:func:`check_same_batch` spread over the micro-batches of an optimizer step.

    :meth:`observe` compares each micro-batch on the device and keeps the result there (no host
    read); :meth:`verify` reads what was observed since the last call once, and raises the same
    ``ValueError`` as :func:`check_same_batch` if any micro-batch differed. Call :meth:`verify`
    before the optimizer step, so that no step is taken on stitched-together samples.

    Args:
        what: the group's name in the error message.
    """

    def __init__(self, what: str = "tensor-parallel") -> None:
        self.what = what
        self._pending: Tensor | None = None
        self._group: dist.ProcessGroup | None = None

    def observe(self, batch: Any, group: dist.ProcessGroup) -> None:
        """Collective over ``group``: compare this micro-batch's fingerprints; a no-op for a group of one."""
        if dist.get_world_size(group) == 1:
            return
        disagree = _disagreement(batch, group)
        self._pending = disagree if self._pending is None else self._pending | disagree
        self._group = group

    def verify(self) -> None:
        """One host read of every comparison since the last call; raises ``ValueError`` if a batch differed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            assert self._group is not None
            _raise_if_disagree(pending, self._group, self.what)
