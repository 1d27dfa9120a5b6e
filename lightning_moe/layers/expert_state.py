"""The checkpoint layout of the routed experts' gated fc1, and the state-dict hooks that present it.

`~lightning_moe.layers.experts.GroupedExperts` stores a gated fc1 as ``[E, 2F, H]``: per expert
the ``F`` gate rows, then the ``F`` up rows, so one GEMM computes both. Its state dict presents
the same numbers as ``experts.fc1_weight`` ``[E, 2, F, H]`` (index 0 of dimension 1: the gate
projection, 1: the up projection), a view of the stored tensor. Non-gated activations keep
``[E, F, H]``.

Why this layout: under expert-tensor parallelism (ETP) each rank holds a block of the gate rows and
the matching block of the up rows. In ``[E, 2, F, H]`` those are ``[:, :, f0:f1, :]``, one plain
shard of the global tensor (dimension 2 split over ETP), so a parallelised model's state dict is a
view of what each rank holds: no gather, no collective, at any layout. In ``[E, 2F, H]`` the same
rows are two separate ranges, which no DTensor sharding describes.

Older checkpoints hold ``[E, 2F, H]`` (the layout before ``[E, 2, F, H]``): the same numbers in
the same order, ``old.view(E, 2, F, H)`` being the new tensor, so converting is a reshape. The
load hook accepts both; sharded checkpoints of the old layout are read through
:mod:`lightning_moe.checkpoint.legacy`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from lightning_moe.layers.activations import is_gated

__all__ = [
    "FC1_KEY", "accept_checkpoint_layout", "fc1_checkpoint_shape", "fc1_checkpoint_view", "fc1_from_checkpoint",
    "present_checkpoint_layout",
]

FC1_KEY = "fc1_weight"
"""The routed experts' fc1 in the state dict (``experts.fc1_weight`` of a `MoELayer`)."""


def fc1_checkpoint_shape(stored: Sequence[int]) -> tuple[int, ...]:
    """The checkpoint shape ``(E, 2, F, H)`` of a gated fc1 stored as ``stored`` = ``(E, 2F, H)``."""
    experts, rows, hidden = stored
    return (experts, 2, rows // 2, hidden)


def fc1_checkpoint_view(fc1: Tensor) -> Tensor:
    """A stored gated fc1 ``[E, 2F, H]`` (or any rank's block of it) as ``[E, 2, F, H]``: a view, never a copy.

    Splitting one dimension in two is a view whatever the strides, so this holds for the
    non-contiguous local shards of sharded data parallelism too.
    """
    return fc1.unflatten(1, (2, fc1.shape[1] // 2))


def fc1_from_checkpoint(value: Tensor) -> Tensor:
    """A gated fc1 of a checkpoint as stored: ``[E, 2, F, H]`` -> ``[E, 2F, H]`` (a view of a
    contiguous tensor); an older checkpoint's ``[E, 2F, H]`` is returned as it is."""
    return value.flatten(1, 2) if value.dim() == 4 else value


def _one_device_fc1(module: nn.Module, value: object) -> bool:
    # A sharded module's state dict is presented by lightning_moe.parallel's hooks (sharded_state_dict).
    return (
        isinstance(value, Tensor) and is_gated(module.activation)
        and not getattr(module, "sharded_state_dict", False) and not hasattr(value, "placements")
    )


def present_checkpoint_layout(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook of `GroupedExperts`: its gated fc1 as ``[E, 2, F, H]`` (a view).

    A module-level function (not a bound method or closure), so models stay picklable and torch
    can tag it as a public hook.
    """
    key = prefix + FC1_KEY
    value = state_dict.get(key)
    if _one_device_fc1(module, value) and value.dim() == 3:
        state_dict[key] = fc1_checkpoint_view(value)


def accept_checkpoint_layout(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook of `GroupedExperts`: a gated fc1 ``[E, 2, F, H]`` back to the
    stored ``[E, 2F, H]``; an older checkpoint's ``[E, 2F, H]`` passes unchanged."""
    key = prefix + FC1_KEY
    value = state_dict.get(key)
    if _one_device_fc1(module, value) and value.dim() == 4 and value.shape[1] == 2:
        state_dict[key] = fc1_from_checkpoint(value)
