"""Qwen2-MoE (``model_type`` ``qwen2_moe``): its sparse-MoE blocks only (:func:`~lightning_moe.swap_moe_blocks`).

Routed as Qwen3-MoE (softmax, top-k, renormalised iff ``norm_topk_prob``), plus a shared expert
of width ``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))`` (our
``shared_expert_gate``). Whole Qwen2-MoE models are not loaded (no ``architecture``).
"""

from __future__ import annotations

from lightning_moe.layers.config import MoEConfig
from lightning_moe.models.hf.fields import Fields
from lightning_moe.models.hf.registry import Family, register_family
from lightning_moe.models.hf.softmax_family import softmax_moe
from lightning_moe.models.hf.weights import shared_mlp_sources

__all__ = ["QWEN2_MOE"]


def _moe(fields: Fields) -> MoEConfig:
    shared = {"shared_expert_ffn_hidden_size": int(fields["shared_expert_intermediate_size"]),
              "shared_expert_gate": True}
    return softmax_moe(fields, "moe_intermediate_size", renormalise=bool(fields["norm_topk_prob"]), shared=shared)


QWEN2_MOE = register_family(Family(
    name="qwen2_moe", title="Qwen2-MoE",
    defaults={"norm_topk_prob": False, "router_aux_loss_coef": 0.001},  # MoE keys only: no whole-model mapping
    expert_count_keys=("num_experts",),
    moe_config=_moe,
    block_class="Qwen2MoeSparseMoeBlock",
    block_weights={**shared_mlp_sources("shared_expert"), "shared_expert.gate.weight": "shared_expert_gate.weight"},
))
"""The Qwen2-MoE family (MoE blocks only), registered."""
