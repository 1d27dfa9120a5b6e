"""How a layer's full initial values go into a weight that parallelism made a DTensor.

The layers do not use ``torch.distributed``, so they cannot cut a DTensor's slice themselves:
every function of this package that turns a layer's weights into DTensors first calls
:func:`enable_sharded_init`, which hands :func:`write_sharded` to
:func:`lightning_moe.layers.weight_init.write_full`. Importing this package changes nothing.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from lightning_moe.compat import is_strided_shard
from lightning_moe.layers.weight_init import set_sharded_writer

__all__ = ["enable_sharded_init", "local_block", "write_sharded"]


def _chunk(start: int, length: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``parts`` of ``[start, start + length)`` as ``torch.chunk`` cuts it (as DTensor
    and FSDP2 do: equal parts rounded up, the last ones shorter or empty)."""
    size = math.ceil(length / parts) if length else 0
    offset = min(index * size, length)
    return start + offset, min(size, length - offset)


def _is_shard_of(placement, dim: int) -> bool:
    """A plain ``Shard(dim)`` (not a strided one)."""
    return isinstance(placement, Shard) and not is_strided_shard(placement) and placement.dim == dim


def local_block(weight: Tensor) -> tuple[tuple[int, int], ...] | None:
    """``(start, length)`` in every dimension of the DTensor ``weight``'s global shape of the block
    this rank holds, or None where the local shard is not one block (a partial placement, a strided
    shard that is not FSDP2's over tensor-parallel shards, a rank outside the mesh).

    Shards apply left to right over the mesh dimensions, each cutting the block the earlier ones
    left. A ``_StridedShard(d, split_factor)`` (FSDP2 over a dimension that tensor parallelism shards
    too) cuts after the shards of ``d`` to its right, whose sizes multiply to ``split_factor``.
    """
    mesh, placements = weight.device_mesh, weight.placements
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    cuts: dict[int, list[int]] = {}  # tensor dim -> mesh dims cutting it, in the order they cut
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if is_strided_shard(placement):
            later = [m for m in range(mesh_dim + 1, mesh.ndim) if _is_shard_of(placements[m], placement.dim)]
            if cuts.get(placement.dim) or math.prod(mesh.size(m) for m in later) != placement.split_factor:
                return None
            # The shards to the right cut first; this one cuts what they left.
            cuts[placement.dim] = [*later, mesh_dim]
        elif _is_shard_of(placement, placement.dim):
            order = cuts.setdefault(placement.dim, [])
            if mesh_dim not in order:  # else already placed by a strided shard to its left
                order.append(mesh_dim)
        else:
            return None
    block = []
    for dim, length in enumerate(weight.shape):
        start = 0
        for mesh_dim in cuts.get(dim, []):
            start, length = _chunk(start, length, mesh.size(mesh_dim), coordinate[mesh_dim])
        block.append((start, length))
    return tuple(block)


@torch.no_grad()
def write_sharded(weight: Tensor, values: Tensor, index: int | None = None) -> None:
    """Write this rank's slice of ``values`` into the DTensor ``weight`` (or into ``weight[index]``).

    Every rank holds the same ``values``, so no communication is needed. This rank's block is cut
    from ``values`` where they are (the host, where layers draw them) and copied into the local
    shard: nothing of the global size is allocated on the device. With ``index`` (one expert of
    stacked expert weights), ``values`` is that expert's full tensor and dimension 0 of ``weight``
    must not be sharded.
    """
    block = local_block(weight)
    if block is None:
        if index is not None:
            raise ValueError(
                f"write_sharded(index=...) needs a shard that is one block, got placements {weight.placements}; "
                "write the whole tensor instead (index=None) for such a layout"
            )
        # Not one block: DTensor cuts the shard itself (a copy of ``values`` on the device, for this tensor only).
        weight.copy_(distribute_tensor(values.to(weight.device), weight.device_mesh, weight.placements, src_data_rank=None))
        return
    local = weight.to_local()
    if index is not None:
        if block[0] != (0, weight.shape[0]):
            raise ValueError(
                f"write_sharded(index=...) needs dimension 0 unsharded, got placements {weight.placements}; "
                "write the whole tensor instead (index=None) when dimension 0 is sharded"
            )
        local, block = local[index], block[1:]
    for dim, (start, length) in enumerate(block):
        values = values.narrow(dim, start, length)
    local.copy_(values)


def enable_sharded_init() -> None:
    """Let the layers write their full initial values into weights that this package made DTensors.

    Called by ``apply_tensor_parallel``, ``apply_user_tensor_parallel``, ``apply_expert_parallel`` and
    ``apply_fully_shard`` (so by ``parallelize``) before they shard anything; calling it again changes
    nothing. A script that makes DTensors of the layers' weights by other means calls it itself
    before ``reset_parameters()``.
    """
    set_sharded_writer(write_sharded)
