"""DeepSeek-V3 (``model_type`` ``deepseek_v3``; Kimi K2 too): multi-head latent attention, sigmoid routing with groups.

As ``transformers`` 5.24's ``modeling_deepseek_v3``: sigmoid scores, ``e_score_correction_bias``
added for selection only (our expert bias), groups scored by their top-2 biased scores,
renormalised, times ``routed_scaling_factor``; ``n_shared_experts`` ungated shared experts; the
first ``first_k_dense_replace`` layers dense. ``seq_aux`` / ``aux_loss_alpha`` map to
``seq_aux_loss``. Kimi K2's ``config.json`` (``model_type`` ``kimi_k2``: the same architecture,
with 384 experts and one group) reads as this family. Checkpoints carry multi-token-prediction layers past ``num_hidden_layers``,
which this model does not implement: loading skips them with a warning; writing adds the zero
score-correction bias a model without expert bias lacks. The router and layer pattern are shared
with GLM-4.5 (:mod:`lightning_moe.models.hf.sigmoid_family`).
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

__all__ = ["DEEPSEEK_V3"]


def _moe(fields: Fields) -> MoEConfig:
    balancing = {}
    if fields["seq_aux"] and fields["aux_loss_alpha"]:
        balancing = {"load_balancing": ["seq_aux_loss"], "aux_loss_coeff": float(fields["aux_loss_alpha"])}
    return sigmoid_moe(fields, balancing)


def _model(fields: Fields, common: dict[str, Any]) -> MoETransformerConfig:
    if common["num_kv_heads"] is not None:
        raise ValueError(
            f"num_key_value_heads={fields['num_key_value_heads']} differs from num_attention_heads="
            f"{common['num_attention_heads']}: multi-head latent attention has one key/value per head."
        )
    return MoETransformerConfig(
        **common, ffn_hidden_size=int(fields["intermediate_size"]), attention="mla",
        q_lora_rank=fields["q_lora_rank"], kv_lora_rank=int(fields["kv_lora_rank"]),
        qk_nope_head_dim=int(fields["qk_nope_head_dim"]), qk_rope_head_dim=int(fields["qk_rope_head_dim"]),
        v_head_dim=int(fields["v_head_dim"]), rope_interleaved=bool(fields["rope_interleave"]),
        first_dense_layers=int(fields["first_k_dense_replace"]), moe=_moe(fields),
    )


def _export_problems(config: MoETransformerConfig) -> list[str]:
    return sigmoid_router_problems(config, "deepseek_v3")


def _export_fields(config: MoETransformerConfig) -> dict[str, Any]:
    seq_coeff = config.moe.aux_loss_coeffs.get("seq_aux_loss", 0.0)
    return {
        **sigmoid_fields(config),
        "num_key_value_heads": config.num_attention_heads, "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim, "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim, "rope_interleave": config.rope_interleaved,
        "moe_layer_freq": 1, "num_nextn_predict_layers": 0, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "seq_aux": bool(seq_coeff), "aux_loss_alpha": seq_coeff,
    }


DEEPSEEK_V3 = register_family(Family(
    name="deepseek_v3", title="DeepSeek-V3", architecture="DeepseekV3ForCausalLM",
    defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 10000.0,
              "norm_topk_prob": True, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
              "n_shared_experts": 1, "first_k_dense_replace": 3, "rope_interleave": True,
              "q_lora_rank": 1536, "num_key_value_heads": None, "seq_aux": False, "aux_loss_alpha": 0.0},
    expert_count_keys=("n_routed_experts", "num_local_experts"),
    moe_config=_moe, model_config=_model,
    attention="mla", qk_norm=None, interleaved_rope=True,
    export_problems=_export_problems, export_fields=_export_fields,
    weight_defaults=zero_score_bias,
    trailing_layers=("DeepSeek-V3's multi-token-prediction module", "multi-token prediction is not implemented"),
    model_type_aliases=("kimi_k2",),  # Kimi K2's config.json names its copy of DeepSeek-V3's code so
    block_class="DeepseekV3MoE",
    block_weights={"router.expert_bias": "gate.e_score_correction_bias", **shared_mlp_sources("shared_experts")},
))
"""The DeepSeek-V3 family, registered."""
