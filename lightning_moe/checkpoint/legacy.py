"""Sharded checkpoints of the older gated-fc1 layout ``[E, 2F, H]`` load through a conversion.

A gated fc1 is in the state dict as ``experts.fc1_weight`` ``[E, 2, F, H]``
(:mod:`lightning_moe.layers.expert_state`); earlier checkpoints hold it as ``[E, 2F, H]``, the
same numbers in the same order. :func:`adopt_legacy_fc1` prepares the templates of a load for such
a checkpoint: each gated-fc1 tensor (the weight or an optimizer state of it: a key with a
``fc1_weight`` part) whose entry in the checkpoint has the older shape is replaced by a template
of that shape, which the experts' load hooks and
:func:`~lightning_moe.checkpoint.sharded.load_optimizer_state_dict` accept:

* a plain tensor (a one-device model): a ``[E, 2F, H]`` tensor;
* a DTensor: one on the same mesh, sharded as before over the experts (and H under sharded data
  parallelism), with the whole F: this rank's experts with all their gate and up rows, since a
  rank's block of the gate rows and of the up rows is not one range of the older layout. At
  ETP > 1 that read holds ETP times this rank's fc1 until the load hooks keep its block; the
  older format's own save held as much (it gathered fc1 over ETP).

Entries of any other shape are left alone (the entry check reports them). Nothing is read and
nothing is communicated here: the templates only change shape.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_moe.compat import compute_local_shape_and_global_offset
from lightning_moe.layers.expert_state import FC1_KEY
from lightning_moe.parallel.expert_parallel import contiguous_strides

__all__ = ["adopt_legacy_fc1", "legacy_fc1_shape"]


def legacy_fc1_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The older ``(E, 2F, H)`` of a gated fc1 whose state-dict shape is ``(E, 2, F, H)``."""
    experts, two, ffn, hidden = shape
    return (experts, two * ffn, hidden)


def _legacy_placement(placement: Any) -> Any:
    # [E, 2, F, H] -> [E, 2F, H]: the experts stay dimension 0, H moves to 2, F is read whole.
    if isinstance(placement, Shard):
        return {0: Shard(0), 3: Shard(2)}.get(placement.dim, Replicate())
    return placement


def _legacy_template(template: Tensor) -> Tensor:
    shape = legacy_fc1_shape(tuple(template.shape))
    if not isinstance(template, DTensor):
        return torch.empty(shape, dtype=template.dtype, device=template.device)
    mesh = template.device_mesh
    placements = [_legacy_placement(p) for p in template.placements]
    local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    local = torch.empty(local_shape, dtype=template.dtype, device=template.to_local().device)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=contiguous_strides(shape)
    )


def _is_fc1(fqn: str) -> bool:
    return FC1_KEY in fqn.split(".")


def adopt_legacy_fc1(templates: dict[str, Any], metadata: Metadata) -> list[str]:
    """Replace, in the nested ``templates`` (in place), the gated-fc1 tensors that ``metadata``
    holds in the older ``[E, 2F, H]`` layout by templates of that layout (module docstring).

    Keys are DCP's flat keys (nested dict keys joined by dots). Returns the keys replaced.
    """
    entries = metadata.state_dict_metadata
    replaced: list[str] = []

    def walk(container: dict, prefix: str) -> None:
        for key, value in list(container.items()):
            fqn = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, dict):
                walk(value, fqn)
                continue
            if not isinstance(value, Tensor) or value.dim() != 4 or value.shape[1] != 2 or not _is_fc1(fqn):
                continue
            entry = entries.get(fqn)
            if isinstance(entry, TensorStorageMetadata) and tuple(entry.size) == legacy_fc1_shape(tuple(value.shape)):
                container[key] = _legacy_template(value)
                replaced.append(fqn)

    walk(templates, "")
    return replaced
