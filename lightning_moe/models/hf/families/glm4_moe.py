"""GLM-4.5 / GLM-4.6 (``model_type`` ``glm4_moe``): DeepSeek-V3's router with grouped-query attention.

As ``transformers`` 5.25's ``modeling_glm4_moe``: the sigmoid router with the score-correction
bias, groups, renormalisation and ``routed_scaling_factor`` (:mod:`..sigmoid_family`, exactly
DeepSeek-V3's); ``n_shared_experts`` ungated shared experts; the first ``first_k_dense_replace``
layers dense; partial rotary (``partial_rotary_factor``, 0.5 when absent: the first half of each
head is rotated, pairing ``j`` with ``j + R/2``, the rest passes through); q/k RMSNorm per head
when ``use_qk_norm``; q/k/v biases when ``attention_bias``. Checkpoints carry multi-token-prediction
layers past ``num_hidden_layers`` (``num_nextn_predict_layers``), which this model does not
implement: loading skips them with a warning.
"""

from __future__ import annotations

from typing import Any

from lightning_moe.layers.config import MoEConfig
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.fields import Fields
from lightning_moe.models.hf.registry import Family, register_family
from lightning_moe.models.hf.sigmoid_family import (
    sigmoid_fields,
    sigmoid_moe,
    sigmoid_router_problems,
    zero_score_bias,
)
from lightning_moe.models.hf.weights import shared_mlp_sources

__all__ = ["GLM4_MOE"]


def _moe(fields: Fields) -> MoEConfig:
    return sigmoid_moe(fields)


def _model(fields: Fields, common: dict[str, Any]) -> MoETransformerConfig:
    head_dim = fields.raw.get("head_dim")
    return MoETransformerConfig(
        **common, head_dim=None if head_dim is None else int(head_dim),
        ffn_hidden_size=int(fields["intermediate_size"]), qk_norm=bool(fields["use_qk_norm"]),
        first_dense_layers=int(fields["first_k_dense_replace"]), moe=_moe(fields),
    )


def _export_problems(config: MoETransformerConfig) -> list[str]:
    return sigmoid_router_problems(config, "glm4_moe")


def _export_fields(config: MoETransformerConfig) -> dict[str, Any]:
    fields = {
        **sigmoid_fields(config), "num_key_value_heads": config.kv_heads,
        "use_qk_norm": config.qk_norm_mode is not None, "partial_rotary_factor": config.partial_rotary_factor,
        "num_nextn_predict_layers": 0,
    }
    if config.head_dim is not None:
        fields["head_dim"] = config.head_dim
    return fields


GLM4_MOE = register_family(Family(
    name="glm4_moe", title="GLM-4.5", architecture="Glm4MoeForCausalLM",
    defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 10000.0,
              "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
              "n_shared_experts": 1, "first_k_dense_replace": 1, "use_qk_norm": False,
              "partial_rotary_factor": 0.5, "num_key_value_heads": 8, "intermediate_size": 10944,
              "moe_intermediate_size": 1408, "num_experts_per_tok": 8},
    expert_count_keys=("n_routed_experts", "num_local_experts"),
    moe_config=_moe, model_config=_model,
    attention="mha", qk_norm="head", optional_qk_norm=True, attention_bias_key="attention_bias",
    partial_rotary=True, export_problems=_export_problems, export_fields=_export_fields,
    weight_defaults=zero_score_bias,
    trailing_layers=("GLM-4.5's multi-token-prediction layers", "multi-token prediction is not implemented"),
    block_class="Glm4MoeMoE",
    block_weights={"router.expert_bias": "gate.e_score_correction_bias", **shared_mlp_sources("shared_experts")},
))
"""The GLM-4.5 family, registered."""
