"""`WeightCastCache`: the expert weights' narrower-dtype copies, made once per parameter version."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from lightning_moe.compat import tensor_version

__all__ = ["WeightCastCache"]


class WeightCastCache:
    """Copies of the expert weights in a narrower compute dtype, made once per parameter version.

    Under ``bf16-mixed`` the fp32 weights are cast to bf16 for the GEMMs. autocast's own cache
    lives for one autocast region (one micro-batch under Lightning); this one keys each copy by
    the parameter's version counter, which in-place updates bump (the optimizer step, loading a
    state dict, re-initialisation), so gradient accumulation over several micro-batches casts once
    per step. The copy is differentiable: each use's gradient reaches the fp32 parameter through it.

    Memory: at most one copy per weight is kept (half the fp32 weights' bytes for bf16). A stale
    copy is replaced at the next forward (the old one is freed once no autograd graph holds it),
    and a forward that needs no cast (fp32 compute) drops them all; :meth:`clear` drops them now,
    e.g. before an optimizer step whose peak memory matters. Copies (deepcopy, pickling) start empty.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[weakref.ref, int, Tensor]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def peek(self, name: str) -> Tensor | None:
        """The copy kept for ``name`` (None when there is none), without validating it."""
        entry = self._entries.get(name)
        return None if entry is None else entry[2]

    def get(self, name: str, param: Tensor, dtype: torch.dtype) -> Tensor:
        """``param.to(dtype)``, reused while ``param`` is the same unmodified tensor."""
        needs_graph = torch.is_grad_enabled() and param.requires_grad
        entry = self._entries.get(name)
        if entry is not None:
            owner, version, cast = entry
            if (
                owner() is param and version == tensor_version(param) and cast.dtype == dtype
                and cast.device == param.device and (cast.requires_grad or not needs_graph)
            ):
                return cast
        # A copy made under no_grad is not differentiable: replaced by the next training forward.
        cast = param.to(dtype)
        self._entries[name] = (weakref.ref(param), tensor_version(param), cast)
        return cast

    def clear(self) -> None:
        """Drop every copy."""
        self._entries.clear()
