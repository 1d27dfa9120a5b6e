"""`DispatchAudit`: the collectives and the new storage of everything run inside it, on one rank.

A ``TorchDispatchMode`` sees every ATen op, process-group collectives included (``c10d`` and
``_c10d_functional`` ops), so it answers "is this call a collective?" on the fake backend, where
a collective returns at once instead of hanging. DTensor ops are handed back to DTensor
(``NotImplemented``, as ``torch.distributed._tools.mem_tracker.MemTracker`` does), so the audit
sees the local ops they run: a DTensor's own storage is a wrapper whose size is the *global*
tensor's and holds nothing, and counting it would report memory no rank allocates.

New storage: an op output whose storage is neither one of the ``known`` storages (the held shards)
nor one already counted is new; its bytes count while it lives (``peak_bytes``). A view, reshape
or detach of a held shard shares its storage and counts nothing. Ops that DTensor's sharding
propagation runs on fake tensors of its own (shape inference, not memory) are skipped.
"""

from __future__ import annotations

import weakref

import torch
from torch._guards import active_fake_mode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_moe.planning.step_probe import COLLECTIVE_NAMESPACES

__all__ = ["COLLECTIVE_NAMESPACES", "DispatchAudit", "storage_key"]



def storage_key(tensor: torch.Tensor) -> int:
    """Identity of the storage behind ``tensor`` (a DTensor: its local shard's)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.untyped_storage()._cdata


class DispatchAudit(TorchDispatchMode):
    """Records collectives (``collectives``: op names) and new storage (``new_storages``, ``peak_bytes``)."""

    def __init__(self, known: set[int] = frozenset()) -> None:
        super().__init__()
        self.known = set(known)
        self.collectives: list[str] = []
        self.new_storages = 0
        self.live = self.peak_bytes = 0
        self._seen: set[int] = set()
        self._fake_mode = None

    def __enter__(self):
        self._fake_mode = active_fake_mode()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back through here
        if func.namespace in COLLECTIVE_NAMESPACES:
            self.collectives.append(str(func))
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is self._fake_mode:
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor):
                    self._count(tensor.untyped_storage())
        return out

    def _count(self, storage) -> None:
        key = storage._cdata
        if key in self.known or key in self._seen:
            return
        self._seen.add(key)
        self.new_storages += 1
        self.live += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.live)
        weakref.finalize(storage, self._release, key, storage.nbytes())

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes
