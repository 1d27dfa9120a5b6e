"""`LiveBytes`: the live and peak bytes of the storages that ops create while it is active.

A ``TorchDispatchMode``: every op's outputs are looked at, each new storage (not on the meta
device) is counted once, until it is freed (a ``weakref.finalize`` on the storage; torch keeps one
Python object per storage, so it fires when the storage itself dies). Tensor subclasses that wrap
others (DTensor) are counted through the tensors they hold. Works on real tensors and under
``FakeTensorMode`` (enter the fake mode first), where nothing is allocated but sizes are real.

Storages that existed before the mode was entered are not counted, and neither is memory an op
uses internally and frees before returning (a kernel's workspace). A storage resized without an op
(FSDP2 allocates and frees its unsharded parameters so) is followed inside :func:`follow_fsdp_resizes`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator

import torch

from lightning_moe.compat import (
    TorchDispatchMode,
    fsdp_storage_modules,
    is_traceable_wrapper_subclass,
    storage_identity,
    tree_flatten,
)

__all__ = ["LiveBytes", "follow_fsdp_resizes", "held_bytes", "storage_bytes"]


class LiveBytes(TorchDispatchMode):
    """``live``: bytes of the storages created since entering that are still alive; ``peak``: its maximum."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: set[int] = set()
        self._sizes: dict[int, int] = {}  # storage key -> bytes counted for it now (resizes change it)
        # Storages may die on other threads (a collective's worker): counts change under a lock.
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):
                    self._count(inner)
            return
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key, nbytes = storage_identity(storage), storage.nbytes()
        with self._lock:
            if key in self._alive:
                return
            self._alive.add(key)
            self._sizes[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        with self._lock:
            if key in self._alive:
                self._alive.discard(key)
                self.live -= self._sizes.pop(key, nbytes)

    def resized(self, tensor: torch.Tensor, before: int) -> None:
        """``tensor``'s storage was resized in place from ``before`` bytes to its size now."""
        storage = tensor.untyped_storage()
        key, after = storage_identity(storage), storage.nbytes()
        with self._lock:
            known = key in self._alive
            if known:
                self.live += after - self._sizes.get(key, before)
                self._sizes[key] = after
                self.peak = max(self.peak, self.live)
        if not known and after:
            self._count(tensor)  # first seen now, at its new size


@contextlib.contextmanager
def follow_fsdp_resizes(counter: LiveBytes) -> Iterator[None]:
    """Tell ``counter`` of every storage FSDP2 resizes: it allocates and frees the unsharded
    parameters with ``alloc_storage``/``free_storage`` (``storage.resize_``), which no dispatch mode
    sees. Wraps those two functions where FSDP2 looks them up, for the body only."""
    def wrap(original):
        def resize(tensor: torch.Tensor) -> None:
            before = tensor.untyped_storage().nbytes()
            original(tensor)
            counter.resized(tensor, before)
        return resize

    patched = [(module, name, getattr(module, name)) for module in fsdp_storage_modules()
               for name in ("alloc_storage", "free_storage") if hasattr(module, name)]
    for module, name, original in patched:
        setattr(module, name, wrap(original))
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's local shard; a storage that
    several tensors or views share, once; meta tensors hold none)."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.device.type != "meta":
            storage = local.untyped_storage()
            storages[storage_identity(storage)] = storage.nbytes()
    return sum(storages.values())


def held_bytes(module: torch.nn.Module) -> int:
    """Bytes of the storages behind ``module``'s parameters and buffers (`storage_bytes`)."""
    return storage_bytes((*module.parameters(), *module.buffers()))
