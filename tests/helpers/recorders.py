"""Dispatch-level recorders shared by the precision tests."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


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
