"""Adapter-only checkpoints: what a LoRA run saves, and the identity of the base it needs back.

A LoRA run trains only the adapters, so its checkpoints hold only them (and, through the
optimizer, their moments): :func:`adapter_state` filters a state dict. The frozen base is not
saved; it comes back from where it came from (``init_from``, or the seeded initialisation of the
configuration), and :func:`base_fingerprint` records which base that was: per base tensor its
element count, sum and sum of squares in float64, computed from each rank's shards and summed
over the ranks that shard it, so the same base gives the same numbers at every layout (up to the
order of the float64 sums, which :func:`base_mismatches` allows for). A resumed run compares the
fingerprint of the base it loaded with the recorded one before training on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_moe.lora.apply import is_adapter_key

__all__ = ["FINGERPRINT_RTOL", "LORA_RECORD_KEY", "adapter_state", "base_fingerprint", "base_mismatches"]

LORA_RECORD_KEY = "lightning_moe_lora"
"""Key of a LoRA checkpoint's record: the config, ``init_from`` and the base's fingerprint."""
FINGERPRINT_RTOL = 1e-9
"""Relative tolerance of two fingerprints of one base (float64 sums of the same values in another order)."""


def adapter_state(state_dict: Mapping[str, object]) -> dict[str, object]:
    """The adapter entries of ``state_dict`` (what a LoRA checkpoint holds of the model)."""
    return {key: value for key, value in state_dict.items() if is_adapter_key(key)}


def _moments(tensor: Tensor) -> Tensor:
    """``[numel, sum, sum of squares]`` of this rank's part of ``tensor``, summed over the ranks sharing it."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    values = local.detach().to(torch.float64)
    moments = torch.stack([torch.tensor(float(values.numel()), dtype=torch.float64, device=values.device),
                           values.sum(), values.square().sum()])
    if isinstance(tensor, DTensor):
        for dim, placement in enumerate(tensor.placements):
            if not placement.is_replicate():  # a shard (or partial sum) of the tensor on each rank of this dim
                dist.all_reduce(moments, group=tensor.device_mesh.get_group(dim))
    return moments.cpu()


@torch.no_grad()
def base_fingerprint(model: nn.Module) -> dict[str, list[float]]:
    """``{key: [numel, sum, sum of squares]}`` of every non-adapter tensor of ``model``'s state dict.

    Collective when the model is distributed (every rank calls it): DTensor shards are summed over
    their mesh, and under pipeline parallelism the stages' entries are gathered, so every rank
    returns the whole model's fingerprint.
    """
    state = model.state_dict()
    prints = {
        key: _moments(value).tolist()
        for key, value in state.items()
        if isinstance(value, Tensor) and not is_adapter_key(key) and value.is_floating_point()
    }
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, prints)
        prints = {key: value for part in gathered for key, value in (part or {}).items()}
    return dict(sorted(prints.items()))


def base_mismatches(recorded: Mapping[str, list[float]], current: Mapping[str, list[float]]) -> list[str]:
    """The base tensors whose fingerprints differ (by name, with both values); empty when the base is the same.

    Sums are compared to ``FINGERPRINT_RTOL`` of ``sqrt(numel * sum of squares)`` (a bound of the
    sum of magnitudes), sums of squares to ``FINGERPRINT_RTOL`` of themselves.
    """
    problems = [f"{key}: in the checkpoint's base, not in this model" for key in sorted(set(recorded) - set(current))]
    problems += [f"{key}: in this model, not in the checkpoint's base" for key in sorted(set(current) - set(recorded))]
    for key in sorted(set(recorded) & set(current)):
        (n0, s0, q0), (n1, s1, q1) = recorded[key], current[key]
        scale = math.sqrt(max(n0 * q0, 0.0))
        if n0 != n1 or abs(s0 - s1) > FINGERPRINT_RTOL * scale + 1e-30 or abs(q0 - q1) > FINGERPRINT_RTOL * q0 + 1e-30:
            problems.append(f"{key}: checkpoint (numel, sum, sum of squares) {(n0, s0, q0)}, now {(n1, s1, q1)}")
    return problems
