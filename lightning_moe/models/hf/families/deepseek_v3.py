"""DeepSeek-V3 (``model_type`` ``deepseek_v3``): multi-head latent attention, sigmoid routing with groups.

As ``transformers`` 5.24's ``modeling_deepseek_v3``: sigmoid scores, ``e_score_correction_bias``
added for selection only (our expert bias), groups scored by their top-2 biased scores,
renormalised, times ``routed_scaling_factor``; ``n_shared_experts`` ungated shared experts; the
first ``first_k_dense_replace`` layers dense. ``seq_aux`` / ``aux_loss_alpha`` map to
``seq_aux_loss``. Checkpoints carry multi-token-prediction layers past ``num_hidden_layers``,
which this model does not implement: loading skips them with a warning; writing adds the zero
score-correction bias a model without expert bias lacks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_moe.layers.config import MoEConfig
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.fields import Fields
from lightning_moe.models.hf.registry import Family, register_family
from lightning_moe.models.hf.weights import shared_mlp_sources

__all__ = ["DEEPSEEK_V3"]


def _moe(fields: Fields) -> MoEConfig:
    top_k, experts = int(fields["num_experts_per_tok"]), fields.expert_count()
    if not fields["norm_topk_prob"] or top_k < 2:
        raise ValueError(
            f"DeepSeek-V3 with norm_topk_prob={fields['norm_topk_prob']} and num_experts_per_tok={top_k} is "
            "not supported: sigmoid routing here renormalises the top-k weights, which needs norm_topk_prob=true "
            "and at least 2 experts per token."
        )
    groups, group_top_k = fields["n_group"], fields["topk_group"]
    if not groups or groups == 1 or group_top_k == groups:
        groups = group_top_k = None  # every group selected: plain top-k
    elif top_k // group_top_k != 2:
        raise ValueError(
            f"transformers' DeepSeek-V3 scores each expert group by its top 2 experts; this router scores it "
            f"by num_experts_per_tok // topk_group = {top_k} // {group_top_k} = {top_k // group_top_k}. "
            "Supported: num_experts_per_tok // topk_group == 2 (DeepSeek-V3: 8 // 4), n_group 1 or "
            "topk_group == n_group."
        )
    ffn, shared = int(fields["moe_intermediate_size"]), int(fields["n_shared_experts"] or 0)
    balancing = {}
    if fields["seq_aux"] and fields["aux_loss_alpha"]:
        balancing = {"load_balancing": ["seq_aux_loss"], "aux_loss_coeff": float(fields["aux_loss_alpha"])}
    scaling = float(fields["routed_scaling_factor"])
    return MoEConfig(
        hidden_size=int(fields["hidden_size"]), ffn_hidden_size=ffn, num_experts=experts, top_k=top_k,
        score_func="sigmoid", num_groups=groups, group_top_k=group_top_k,
        topk_scaling_factor=None if scaling == 1.0 else scaling,
        expert_bias=True, shared_expert_ffn_hidden_size=shared * ffn or None,
        init_std=float(fields["initializer_range"]), **balancing,
    )


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
    moe, problems = config.moe, []
    if moe.score_func != "sigmoid" or moe.top_k < 2:
        problems.append(
            f"score_func={moe.score_func!r} with top_k={moe.top_k}: deepseek_v3 renormalises sigmoid scores "
            "over at least 2 experts"
        )
    if moe.num_groups is not None and moe.group_top_k != moe.num_groups and moe.top_k // moe.group_top_k != 2:
        problems.append(
            f"top_k // group_top_k = {moe.top_k // moe.group_top_k}: deepseek_v3 scores groups by their "
            "top 2 experts"
        )
    shared = moe.shared_expert_ffn_hidden_size or 0
    if not shared or shared % moe.ffn_hidden_size:
        problems.append(
            f"shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}: deepseek_v3 has "
            f"n_shared_experts >= 1 shared experts of width moe_intermediate_size={moe.ffn_hidden_size}"
        )
    expected = [i >= config.first_dense_layers for i in range(config.num_layers)]
    if [config.is_moe_layer(i) for i in range(config.num_layers)] != expected:
        problems.append(
            "deepseek_v3's dense layers are the first first_k_dense_replace ones, every later one is MoE"
        )
    return problems


def _export_fields(config: MoETransformerConfig) -> dict[str, Any]:
    moe = config.moe
    seq_coeff = moe.aux_loss_coeffs.get("seq_aux_loss", 0.0)
    return {
        "num_key_value_heads": config.num_attention_heads, "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim, "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim, "rope_interleave": config.rope_interleaved,
        "intermediate_size": config.ffn_hidden_size or moe.ffn_hidden_size,
        "moe_intermediate_size": moe.ffn_hidden_size, "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k, "n_group": moe.num_groups or 1,
        "topk_group": moe.group_top_k or 1,
        "routed_scaling_factor": moe.topk_scaling_factor or 1.0, "norm_topk_prob": True,
        "n_shared_experts": moe.shared_expert_ffn_hidden_size // moe.ffn_hidden_size,
        "first_k_dense_replace": config.first_dense_layers, "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "seq_aux": bool(seq_coeff), "aux_loss_alpha": seq_coeff,
    }


def _weight_defaults(names: set[str], config: MoETransformerConfig) -> dict[str, Tensor]:
    # transformers' DeepseekV3 always has the score-correction bias; zeros select as no bias does.
    out = {}
    for index in config.moe_layers:
        name = f"model.layers.{index}.mlp.gate.e_score_correction_bias"
        if name not in names:
            out[name] = torch.zeros(config.moe.num_experts, dtype=torch.float32)
    return out


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
    weight_defaults=_weight_defaults,
    trailing_layers=("DeepSeek-V3's multi-token-prediction module", "multi-token prediction is not implemented"),
    block_class="DeepseekV3MoE",
    block_weights={"router.expert_bias": "gate.e_score_correction_bias", **shared_mlp_sources("shared_experts")},
))
"""The DeepSeek-V3 family, registered."""
