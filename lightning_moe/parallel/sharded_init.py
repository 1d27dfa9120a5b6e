"""How a layer's full initial values go into a weight that parallelism made a DTensor.

Registered with :func:`lightning_moe.layers.weight_init.set_sharded_writer` when
:mod:`lightning_moe.parallel` is imported (the layers do not use ``torch.distributed``).
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["write_sharded"]


def write_sharded(weight: Tensor, values: Tensor, index: int | None = None) -> None:
    """Write this rank's slice of ``values`` into the DTensor ``weight`` (or into ``weight[index]``).

    Every rank holds the same ``values``, so no communication is needed. With ``index``
    (one expert of stacked expert weights), ``values`` is that expert's full tensor and dimension
    0 of ``weight`` must not be sharded.
    """
    if index is None:
        weight.copy_(distribute_tensor(values.to(weight.device), weight.device_mesh, weight.placements, src_data_rank=None))
        return
    shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    if offset[0] != 0 or shape[0] != weight.shape[0]:
        raise ValueError(f"write_sharded(index=...) needs dimension 0 unsharded, got placements {weight.placements}")
    for dim in range(1, weight.dim()):
        values = values.narrow(dim - 1, offset[dim], shape[dim])
    weight.to_local()[index].copy_(values)
