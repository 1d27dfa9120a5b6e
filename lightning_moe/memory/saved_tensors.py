"""Saved-tensor hook plumbing shared by recompute and offload, and an exact saved-bytes counter.

``torch.autograd.graph.saved_tensors_hooks`` do not nest: the innermost pair sees every tensor
autograd saves. The memory features install hooks at module boundaries, inside whatever hooks
the caller already has (a byte counter, an activation checkpoint), so their hooks handle only
the tensors they are responsible for and hand every other tensor to the enclosing pair
(:func:`chained_saved_tensors_hooks`).

:class:`SavedTensorCounter` measures what a forward leaves for backward: unique storages of saved
tensors (views of one storage count once), parameters and buffers excluded, attributed to the
innermost tracked module. Counting storages that are still alive after the forward makes the
number exact and machine independent, and makes it reflect offloading (a storage whose last
device reference was dropped after its copy to host is no longer counted).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_moe.compat import dtensor_local, top_saved_tensors_hooks

__all__ = [
    "NOT_HANDLED",
    "SavedTensorCounter",
    "chained_saved_tensors_hooks",
    "current_saved_tensors_hooks",
    "storage_of",
]

NOT_HANDLED = object()
"""Returned by a chained pack function for tensors it leaves to the enclosing hooks."""


def current_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """The innermost active ``(pack, unpack)`` pair, or None (none active, or torch lacks the query)."""
    return top_saved_tensors_hooks()


def storage_of(tensor: Tensor) -> torch.UntypedStorage | None:
    """The untyped storage behind ``tensor`` (the local shard's for a DTensor), or None."""
    tensor = dtensor_local(tensor)
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _Delegated:
    """What the enclosing hooks packed for a tensor the chained pair did not handle."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: object, unpack: Callable | None) -> None:
        self.packed, self.unpack = packed, unpack


def _is_observer(hooks: tuple[Callable, Callable] | None) -> bool:
    return hooks is not None and getattr(hooks[0], "observes_saved_tensors", False)


class _ChainedHooks(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, pack: Callable[[Tensor], object], unpack: Callable[[object], Tensor]) -> None:
        super().__init__(self._pack_hook, self._unpack_hook)
        self._pack, self._unpack = pack, unpack
        self._enclosing: list[tuple[Callable, Callable] | None] = []

    def _pack_hook(self, tensor: Tensor) -> object:
        outer = self._enclosing[-1] if self._enclosing else None
        packed = self._pack(tensor)
        if packed is not NOT_HANDLED:
            if _is_observer(outer):
                outer[0](tensor)
            return packed
        if outer is None:
            return _Delegated(tensor, None)
        return _Delegated(outer[0](tensor), outer[1])

    def _unpack_hook(self, packed: object) -> Tensor:
        if isinstance(packed, _Delegated):
            return packed.packed if packed.unpack is None else packed.unpack(packed.packed)
        return self._unpack(packed)

    def __enter__(self) -> None:
        self._enclosing.append(current_saved_tensors_hooks())
        super().__enter__()

    def __exit__(self, *args: object) -> None:
        super().__exit__(*args)
        self._enclosing.pop()


def chained_saved_tensors_hooks(
    pack: Callable[[Tensor], object], unpack: Callable[[object], Tensor]
) -> torch.autograd.graph.saved_tensors_hooks:
    """``saved_tensors_hooks`` whose ``pack`` may return :data:`NOT_HANDLED` to pass a tensor on.

    Tensors ``pack`` handles never reach the enclosing hooks, except that an enclosing pack marked
    ``observes_saved_tensors`` (a counter) is shown them too. The enclosing pair is read when the
    returned context is entered. Use it as a context manager, or call ``__enter__``/``__exit__``
    from a module's forward pre-hook and (``always_call=True``) forward hook.
    """
    return _ChainedHooks(pack, unpack)


@dataclass
class _Seen:
    storage: weakref.ref
    nbytes: int
    region: str


class SavedTensorCounter:
    """Count the bytes a forward saves for backward, per region, with saved-tensor hooks.

    Usage::

        counter = SavedTensorCounter(exclude=model)          # parameters and buffers excluded
        handles = counter.track({"attn": block.attn, "experts": block.ffn.experts})
        with counter:
            loss = model(x).sum()
        counter.saved_bytes()          # {"attn": ..., "experts": ..., "other": ...}, storages still alive
        loss.backward()

    Enter it outermost: hooks installed inside it (recompute, offload) show it what they keep.
    A storage counts once, for the innermost tracked module active when it was first saved
    (``"other"`` outside all of them). Only storages alive when :meth:`saved_bytes` is called
    count, so read it after the forward and before backward.
    """

    def __init__(self, exclude: nn.Module | Iterable[Tensor] = ()) -> None:
        tensors = (
            list(exclude.parameters()) + list(exclude.buffers()) if isinstance(exclude, nn.Module) else exclude
        )
        # Strong references keep the ids of excluded storages from being reused.
        self._excluded = [s for s in (storage_of(t) for t in tensors) if s is not None]
        self._excluded_ids = {id(s) for s in self._excluded}
        self._seen: dict[int, _Seen] = {}
        self._regions: list[str] = []
        self.uncounted = 0
        """Saved tensors without a reachable storage (tensor subclasses), not counted."""
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: Tensor) -> Tensor:
        # Marked below as an observer: chained hooks show it the tensors they handle themselves.
        if isinstance(tensor, nn.Parameter):
            return tensor
        storage = storage_of(tensor)
        if storage is None:
            self.uncounted += 1
            return tensor
        key = id(storage)
        if key in self._excluded_ids:
            return tensor
        seen = self._seen.get(key)
        if seen is None or seen.storage() is not storage:
            region = self._regions[-1] if self._regions else "other"
            self._seen[key] = _Seen(weakref.ref(storage), storage.nbytes(), region)
        return tensor

    @staticmethod
    def _unpack(tensor: Tensor) -> Tensor:
        return tensor

    def __enter__(self) -> SavedTensorCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *args: object) -> None:
        self._hooks.__exit__(*args)

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Attribute storages first saved inside this context to ``name``."""
        self._regions.append(name)
        try:
            yield
        finally:
            self._regions.pop()

    def track(self, modules: dict[str, nn.Module]) -> list[torch.utils.hooks.RemovableHandle]:
        """Make each module's forward a region named by its key; returns the hook handles."""
        handles = []
        for name, module in modules.items():

            def enter(_module, _args, name=name):
                self._regions.append(name)

            def leave(_module, _args, _output):
                self._regions.pop()

            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave, always_call=True))
        return handles

    def saved_bytes(self, alive_only: bool = True) -> dict[str, int]:
        """Bytes per region of the unique storages saved (and, by default, still alive)."""
        totals: dict[str, int] = {}
        for seen in self._seen.values():
            if alive_only and seen.storage() is None:
                continue
            totals[seen.region] = totals.get(seen.region, 0) + seen.nbytes
        return totals

    def total_bytes(self, alive_only: bool = True) -> int:
        """Sum of :meth:`saved_bytes` over all regions."""
        return sum(self.saved_bytes(alive_only).values())

    def reset(self) -> None:
        """Forget everything counted so far."""
        self._seen.clear()
        self.uncounted = 0


SavedTensorCounter._pack.observes_saved_tensors = True  # type: ignore[attr-defined]
