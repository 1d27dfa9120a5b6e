"""`return_no_views`: FSDP2 units hand out their outputs as tensors that are not views.

FSDP2 registers its pre-backward hook (which all-gathers a unit's parameters again for the backward
under ``FULL_SHARD``) on every output tensor of a unit. A view loses such a hook when it is
modified in place, so torch warns, once per rank and unit, when a unit returns one ("FSDP2-wrapped
module ... returned a view tensor"). The reference transformer under tensor parallelism does: its
vocabulary-parallel head returns this rank's slice of the logits with ``DTensor.to_local()``, a
view of the DTensor's local tensor. :func:`return_no_views` makes such outputs plain aliases (same
memory, same version counter, no copy; the gradient passes through unchanged), on which an in-place
op keeps FSDP's hook, so there is neither the hazard nor the warning.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, autograd, nn
from torch.distributed.tensor import DTensor

from lightning_moe.compat import tree_map_only, view_base

__all__ = ["return_no_views"]


class _Alias(autograd.Function):
    """Identity whose output shares ``x``'s memory and version counter but is not a view of it."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def _unview(t: Tensor) -> Tensor:
    if isinstance(t, DTensor) or view_base(t) is None or not t.requires_grad:
        return t
    return _Alias.apply(t)


def _hook(module: nn.Module, args: Any, output: Any) -> Any:
    return tree_map_only(Tensor, _unview, output)


def return_no_views(module: nn.Module) -> nn.Module:
    """Make ``module``'s view outputs plain aliases (module docstring); call before ``fully_shard``,
    so the hook runs before FSDP2's post-forward hook, which is registered after it."""
    module.register_forward_hook(_hook)
    return module
