"""Dispatch-level recorders shared by the tests (precision, memory at scale)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class GemmDtypes(TorchDispatchMode):
    """Records ``(operand dtypes, result dtype)`` of every matrix product, as dispatched after autocast."""

    _GEMMS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[torch.dtype, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self._GEMMS:
            operands = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
            self.calls.append((operands, out.dtype))
        return out


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (elements) any operation returns, and which operation made it.

    The mode sees DTensor operations before DTensor runs them on the local shards: a DTensor
    result counts with its local shard, what this rank allocates.
    """

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.where = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, DTensor):
                t = t.to_local()
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.where = t.numel(), f"{func} -> {tuple(t.shape)}"
        return out
