"""One ``torch.save`` file of a sharded model's global state dict, written by one rank as it receives.

:func:`gather_full` puts the full value of one sharded tensor (a DTensor of any mesh and
placements) on the destination rank only: each piece is sent once, by the rank holding it (the
first replica where a mesh dimension replicates), straight into its place in the full tensor. Where
each rank's piece lies comes from ``compat.shard_shape_and_offset_at``,
the function DCP uses to record the chunks of a DTensor it saves, so every layout a sharded
checkpoint can hold is gathered the same way (EP, ETP, TP, FSDP2 and their foldings).

:func:`write_consolidated` streams a state dict through it key by key into a
:class:`~lightning_moe.checkpoint.torch_file_stream.TorchFileStream`: the destination rank holds the
tensor being assembled (in host memory) and at most one received piece, every other rank nothing
but what it already held, never more than one full tensor at a time. The file loads with
``torch.load(path, weights_only=True)`` like any ``torch.save`` file.

The transfers are point-to-point sends to the destination (under NCCL a communicator per pair of
ranks the first time; the file is written at the speed of one rank's link and disk).
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from lightning_moe.checkpoint.torch_file_stream import TorchFileStream
from lightning_moe.compat import shard_shape_and_offset_at

__all__ = ["gather_full", "write_consolidated"]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@functools.lru_cache(maxsize=256)
def _pieces(mesh, placements: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]:
    """``(global rank, local shape, global offset)`` of every distinct non-empty piece, one replica each."""
    pieces = []
    ranks = mesh.mesh
    for coordinate in itertools.product(*(range(size) for size in mesh.shape)):
        if any(c != 0 for c, p in zip(coordinate, placements) if p.is_replicate()):
            continue  # a replica of the piece at coordinate 0 on that mesh dimension
        local_shape, offset = shard_shape_and_offset_at(shape, mesh.shape, list(coordinate), placements)
        if all(size > 0 for size in local_shape):
            pieces.append((int(ranks[coordinate]), tuple(local_shape), tuple(offset)))
    return tuple(pieces)


@functools.lru_cache(maxsize=256)
def _holds(mesh, rank: int) -> bool:
    return rank in mesh.mesh.flatten().tolist()


def gather_full(value: Tensor, dst: int = 0) -> Tensor | None:
    """The full value of ``value`` on rank ``dst`` (a new tensor in host memory), None on other ranks.

    The full tensor is assembled in host memory (pageable: pinning gigabytes per tensor costs more
    than the copies it would speed up): a whole
    global tensor (30 GiB for one DeepSeek-V3 layer's expert fc1 in fp32) would not fit beside the
    training state on rank 0's device. A piece that arrives on the device (NCCL receives into device
    memory only) passes through one piece-sized device buffer.

    A plain tensor is taken as replicated: ``dst``'s own (detached) value, no communication. For a
    DTensor, call on every rank, for the same tensors in the same order: the ranks of ``dst``'s mesh
    that hold a piece send it, ``dst`` receives each piece into its place. A DTensor on a mesh of
    some dimensions only (a tensor-parallel group) is gathered from ``dst``'s group; the other
    groups hold replicas and send nothing.
    """
    rank = _rank()
    if not isinstance(value, DTensor):
        return value.detach().cpu() if rank == dst else None
    if any(p.is_partial() for p in value.placements):  # not in a state dict; reduce it first, everywhere
        value = value.redistribute(placements=[Replicate() if p.is_partial() else p for p in value.placements])
    mesh = value.device_mesh
    if rank != dst and not _holds(mesh, dst):
        # A mesh of some dimensions only (tensor-parallel or FSDP2 weights): the ranks of dst's own
        # group hold the tensor, this group a replica of it.
        return None
    pieces = _pieces(mesh, tuple(value.placements), tuple(value.shape))
    local = value.to_local()
    if rank != dst:
        for src, _, _ in pieces:
            if src == rank:
                dist.send(local.contiguous(), dst)
        return None
    on_device = local.device.type != "cpu"
    full = torch.empty(value.shape, dtype=value.dtype, device="cpu")
    for src, shape, offset in pieces:
        box = full[tuple(slice(start, start + size) for start, size in zip(offset, shape))]
        if src == rank:
            box.copy_(local)
        elif box.is_contiguous() and not on_device:
            dist.recv(box, src)
        else:  # received whole on the pieces' device (or cut along an inner dimension), then put in place
            piece = torch.empty(shape, dtype=value.dtype, device=local.device)
            dist.recv(piece, src)
            box.copy_(piece)
            del piece
    return full


def write_consolidated(state: Mapping[str, Any], extras: dict[str, Any], path: Path, dst: int = 0,
                       state_key: str = "state_dict") -> None:
    """Write ``{**extras, state_key: full state}`` to ``path`` on rank ``dst``, one tensor at a time.

    Collective: every rank calls it with its own ``state`` (same keys, same order; DTensors as in
    :func:`gather_full`). ``extras`` and ``path`` are used on ``dst`` only. The file is flushed and
    ``fsync``-ed. An error on ``dst`` (e.g. a full disk) stops the writing but not the gathering,
    so every rank leaves the collectives together; it is raised on ``dst`` at the end, and the
    caller tells the other ranks.
    """
    writing = _rank() == dst
    error: BaseException | None = None
    file = stream = None
    if writing:
        try:
            file = open(path, "wb")  # noqa: SIM115 (closed below, after the collectives)
            stream = TorchFileStream(file)
        except Exception as err:
            error = err
    written: dict[str, Any] = {}
    try:
        for key, value in state.items():
            full = gather_full(value, dst) if isinstance(value, Tensor) else value
            if writing and error is None:
                try:
                    written[key] = stream.add(full) if isinstance(full, Tensor) else full
                except Exception as err:
                    error = err
            del full  # before the next one is gathered
        if not writing:
            return
        if error is not None:
            raise error
        stream.finish({**extras, state_key: written})
        file.flush()
        os.fsync(file.fileno())
    except BaseException:
        if stream is not None:
            stream.abandon()
        raise
    finally:
        if file is not None:
            file.close()
