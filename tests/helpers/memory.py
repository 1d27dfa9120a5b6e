"""Peak bytes of tensor storages a call holds, counted with a dispatch mode.

:class:`HeldBytes` counts every storage that an operator reads or returns while it is active,
from the first time it is seen until it is freed (a finalizer on the storage), except the
``known`` tensors' storages (what the caller already held: the model, the state it passes in).
A storage created outside the dispatcher (``torch.load``, a collective's buffer) is counted once
an operator touches it, which every use of its values does. Storages that map a file
(``torch.load(mmap=True)``, safetensors) are page cache that the kernel shares between processes
and drops under pressure, not memory a rank holds: they are not counted (Linux: the storage's
address lies in a file mapping of ``/proc/self/maps``).

Upper bound on the live bytes of tensors (a view counts its whole storage); Python objects
(pickles, bytes) are not tensors and not counted.

:func:`peak_rss_growth` measures what the dispatcher cannot see, e.g. ``torch.load`` reading a
file whose tensors no operator touches: the growth of the process's peak resident memory during a
call, run in a forked child (Linux; ``/proc/self/clear_refs`` resets the peak first).
"""

from __future__ import annotations

import bisect
import multiprocessing
import threading
import weakref
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["HeldBytes", "peak_rss_growth", "storage_bytes", "tensors_in"]


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor in a nested structure of dicts, lists and tuples (a DTensor's local tensor)."""
    out = []
    for leaf in tree_leaves(obj):
        if isinstance(leaf, DTensor):
            out.append(leaf.to_local())
        elif isinstance(leaf, torch.Tensor):
            out.append(leaf)
    return out


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def _file_mappings() -> tuple[list[int], list[int]]:
    starts, ends = [], []
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            # address perms offset dev inode [path]: a file mapping has an inode and a path.
            if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                starts.append(start)
                ends.append(end)
    order = sorted(range(len(starts)), key=starts.__getitem__)
    return [starts[i] for i in order], [ends[i] for i in order]


class HeldBytes(TorchDispatchMode):
    """``peak``: the largest sum of live counted storage bytes seen (see the module docstring)."""

    def __init__(self, known: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.known = {t.untyped_storage()._cdata for t in tensors_in(list(known))}
        self.live = self.peak = 0
        self._seen: set[int] = set()
        # Storages may die on other threads (a collective's worker): counts change under a lock.
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tensors_in((args, kwargs or {}, out)):
            self._count(tensor.untyped_storage())
        return out

    def _count(self, storage) -> None:
        key = storage._cdata
        if key in self.known or key in self._seen or storage.device.type == "meta":
            return
        try:
            address = storage.data_ptr()
        except RuntimeError:  # a wrapper subclass (e.g. an async collective's result): its inner tensor counts
            return
        self._seen.add(key)
        nbytes = storage.nbytes()
        if nbytes and self._maps_a_file(address):
            return
        with self._lock:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, nbytes)

    @staticmethod
    def _maps_a_file(address: int) -> bool:
        starts, ends = _file_mappings()
        i = bisect.bisect_right(starts, address) - 1
        return i >= 0 and address < ends[i]

    def _release(self, key: int, nbytes: int) -> None:
        with self._lock:
            self._seen.discard(key)
            self.live -= nbytes


def _peak_rss() -> int:
    with open("/proc/self/status", encoding="utf-8") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


def _measure_in_child(queue, fn: Callable[[], object]) -> None:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
            clear.write("5")  # peak RSS := current RSS
        before = _peak_rss()
        fn()
        queue.put(_peak_rss() - before)
    except BaseException as err:  # reported to the parent, which raises it
        queue.put(err)


def peak_rss_growth(fn: Callable[[], object], timeout_s: float = 60.0) -> int:
    """Bytes by which the peak resident memory grows while ``fn()`` runs in a forked child."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_measure_in_child, args=(queue, fn))
    child.start()
    try:
        result = queue.get(timeout=timeout_s)
    finally:
        child.join(timeout=5)
        if child.is_alive():
            child.kill()
    if isinstance(result, BaseException):
        raise result
    return result
