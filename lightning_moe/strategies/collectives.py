"""`WorldCollectives`: the world-wide collectives Lightning asks a strategy for (barrier, broadcast, reduce)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import group as _group
from torch import Tensor

from lightning_moe.compat import sync_ddp_if_available

__all__ = ["WorldCollectives"]


class WorldCollectives:
    """Mixin of `MoEStrategy`: collectives over the default process group (a no-op without one).

    Uses the strategy's ``root_device`` (NCCL barriers name the device).
    """

    def barrier(self, name: str | None = None) -> None:
        """Synchronise all ranks."""
        if dist.is_initialized():  # NCCL needs the device; gloo takes none
            dist.barrier(**({"device_ids": [self.root_device.index]} if dist.get_backend() == "nccl" else {}))

    def broadcast(self, obj, src: int = 0):
        """Broadcast a picklable object from ``src`` over the world."""
        if not dist.is_initialized():
            return obj
        objects = [obj]
        dist.broadcast_object_list(objects, src, group=_group.WORLD)
        return objects[0]

    def reduce(self, tensor, group: Any | None = None, reduce_op: Any = "mean"):
        """Reduce ``tensor`` over ``group`` (default: the world), e.g. for ``self.log(sync_dist=True)``."""
        if isinstance(tensor, Tensor):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
