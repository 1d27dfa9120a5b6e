"""Comparing a parallelized model with its single-device reference, parameter by parameter.

Shared by the tensor- and context-parallel training tests: each rank notes the largest error per
gradient and per weight (NaN-preserving, :func:`helpers.asserts.worst_error`) against the matching
slice of the reference's tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe.parallel import expert_shard
from lightning_moe.parallel.expert_parallel import _local_slice

Note = Callable[[str, float], None]


def comparable(param: torch.Tensor, value: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's ``value`` as a comparable tensor, the matching slice of ``reference``)."""
    if isinstance(value, DTensor):
        return value.full_tensor(), reference
    shard = expert_shard(param)
    if shard is not None:
        return value, _local_slice(reference, shard, param.shape[0])
    return value, reference


def note_gradients(note: Note, model: nn.Module, reference: nn.Module) -> None:
    """``note("grad <name>", max abs error)`` for every parameter's gradient."""
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        got, want = comparable(param, param.grad, ref_params[name].grad)
        note(f"grad {name}", (got - want).abs().max().item())


def note_weights(note: Note, model: nn.Module, reference: nn.Module) -> None:
    """``note("weight <name>", max abs error)`` for every parameter."""
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        got, want = comparable(param, param.detach(), ref_params[name].detach())
        note(f"weight {name}", (got - want).abs().max().item())


def step_and_zero(*optimizers: torch.optim.Optimizer) -> None:
    """One step of each optimizer, then ``zero_grad(set_to_none=True)``."""
    for optimizer in optimizers:
        optimizer.step()
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
