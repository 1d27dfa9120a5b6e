"""Activation memory utilities (no Lightning): selective recompute, activation offload, byte counting.

* :func:`apply_selective_recompute` — Megatron Core's fine-grained recompute (``moe_act``,
  ``layernorm``, ``shared_experts``, ``router``, ``core_attn``, ``attention``, ``moe``), with
  router side effects recorded once per micro-batch.
* :func:`apply_activation_offload` — fine-grained activation offload of named boundaries
  (``attn_norm``, ``qkv_linear``, ``core_attn``, ``attn_proj``, ``mlp_norm``, ``expert_fc1``,
  ``moe_act``) to pinned host memory on side CUDA streams (the mechanics:
  :mod:`~lightning_moe.memory.offloader`).
* :class:`SavedTensorCounter` — exact saved-activation bytes with saved-tensor hooks.

Both find their modules by the package's layer types and the reference model's names; on a
user's own model, ``targets=`` names its modules for the attention-side names (module types or
qualified-name patterns, :mod:`~lightning_moe.memory.handles`), and names that match nothing are
reported (``handle.unmatched_message``) or refused with ``strict=True``.

The Lightning callbacks ``lightning_moe.callbacks.SelectiveRecompute`` and ``ActivationOffload``
apply these to a LightningModule.
"""

from lightning_moe.memory.offload import (
    OFFLOAD_MODULES,
    ActivationOffloader,
    OffloadHandle,
    OffloadStats,
    apply_activation_offload,
)
from lightning_moe.memory.recompute import (
    RECOMPUTE_MODULES,
    RecomputeHandle,
    apply_selective_recompute,
    checkpoint_module,
    discard_output,
)
from lightning_moe.memory.saved_tensors import SavedTensorCounter, chained_saved_tensors_hooks

__all__ = [
    "OFFLOAD_MODULES",
    "RECOMPUTE_MODULES",
    "ActivationOffloader",
    "OffloadHandle",
    "OffloadStats",
    "RecomputeHandle",
    "SavedTensorCounter",
    "apply_activation_offload",
    "apply_selective_recompute",
    "chained_saved_tensors_hooks",
    "checkpoint_module",
    "discard_output",
]
