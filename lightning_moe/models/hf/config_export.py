""":class:`MoETransformerConfig` -> Hugging Face ``config.json`` of one family (reverse of :mod:`.config_map`).

:func:`infer_family` picks the family a config can only be (MLA: DeepSeek-V3; q/k norm over the
whole projection: OLMoE; per head: Qwen3-MoE; none: Mixtral); :func:`config_to_hf` checks that
the family's ``transformers`` implementation computes exactly this model and refuses, naming
the setting, whatever it cannot hold (a shared expert in Mixtral, sigmoid scores in Qwen3...).
Both the ``transformers`` 5 keys (``rope_parameters``) and the older ones (``rope_theta``,
``rope_scaling``) are written, so earlier ``transformers`` versions read the rotary settings too.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.config_map import ARCHITECTURES, FAMILIES

__all__ = ["PASSTHROUGH_KEYS", "config_to_hf", "infer_family"]

PASSTHROUGH_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""``config.json`` keys this model does not use but keeps from ``from_pretrained`` to ``save_pretrained``."""


def infer_family(config: MoETransformerConfig) -> str:
    """The only family whose attention matches ``config`` (the rest is checked by :func:`config_to_hf`)."""
    if config.attention == "mla":
        return "deepseek_v3"
    return {"full": "olmoe", "head": "qwen3_moe", None: "mixtral"}[config.qk_norm_mode]


def _refuse(family: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(
            f"This model cannot be written as a Hugging Face {family} model: {'; '.join(problems)}. "
            f"Supported families: {', '.join(FAMILIES)} (save_pretrained(path, family=...))."
        )


def _check_common(config: MoETransformerConfig, family: str) -> list[str]:
    moe = config.moe
    problems = []
    if moe is None:
        return [f"a dense model (moe=None) has no {family} form"]
    if moe.activation != "swiglu":
        problems.append(f"experts use activation={moe.activation!r}, {family} uses SwiGLU (silu)")
    if moe.fc2_bias:
        problems.append(f"fc2_bias=True: {family} experts have no bias")
    if moe.shared_expert_gate:
        problems.append(f"shared_expert_gate=True: {family} has no shared-expert gate")
    expected_attention = "mla" if family == "deepseek_v3" else "mha"
    if config.attention != expected_attention:
        problems.append(f"attention={config.attention!r}, {family} uses {expected_attention!r}")
    expected_norm = {"qwen3_moe": "head", "olmoe": "full", "mixtral": None, "deepseek_v3": None}[family]
    if config.attention == "mha" and config.qk_norm_mode != expected_norm:
        problems.append(f"qk_norm={config.qk_norm!r}, {family} uses {expected_norm or 'none'}")
    if family != "deepseek_v3" and config.rope_interleaved:
        problems.append(f"rope_interleaved=True: {family} rotates halves")
    return problems


def _check_softmax_router(config: MoETransformerConfig, family: str) -> list[str]:
    moe, problems = config.moe, []
    if moe.score_func != "softmax":
        problems.append(f"score_func={moe.score_func!r}, {family} routes with softmax")
    if family == "mixtral" and moe.pre_softmax:
        problems.append("pre_softmax=True: mixtral always renormalises the top-k probabilities")
    if moe.num_groups is not None or moe.expert_bias or moe.topk_scaling_factor not in (None, 1.0):
        problems.append(f"group-limited routing, expert bias and topk_scaling_factor do not exist in {family}")
    if moe.shared_expert_ffn_hidden_size:
        problems.append(f"{family} has no shared expert")
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    if dense and family != "qwen3_moe":
        problems.append(f"layers {dense} are dense, every {family} layer is MoE")
    if family == "olmoe" and config.head_dim not in (None, config.hidden_size // config.num_attention_heads):
        problems.append(f"head_dim={config.head_dim}: olmoe derives it as hidden_size / num_attention_heads")
    return problems


def _check_deepseek(config: MoETransformerConfig) -> list[str]:
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


def _rope(config: MoETransformerConfig) -> dict[str, Any]:
    scaling = config.rope_scaling
    if scaling is None:
        return {"rope_theta": config.rope_theta, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta}}
    params = {"rope_type": "yarn", "factor": scaling.factor,
              "original_max_position_embeddings": scaling.original_max_seq_len,
              "beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow, "truncate": scaling.truncate}
    for name in ("mscale", "mscale_all_dim", "attention_factor"):
        if getattr(scaling, name) is not None:
            params[name] = getattr(scaling, name)
    return {"rope_theta": config.rope_theta, "rope_scaling": {**params, "type": "yarn"},
            "rope_parameters": {**params, "rope_theta": config.rope_theta}}


def _aux_coeff(config: MoETransformerConfig, kind: str) -> float:
    return config.moe.aux_loss_coeffs.get(kind, 0.0)


def _family_fields(config: MoETransformerConfig, family: str) -> dict[str, Any]:
    moe, heads = config.moe, config.num_attention_heads
    if family == "deepseek_v3":
        seq_coeff = _aux_coeff(config, "seq_aux_loss")
        return {
            "num_key_value_heads": heads, "q_lora_rank": config.q_lora_rank,
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
    fields = {
        "num_key_value_heads": config.kv_heads, "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": _aux_coeff(config, "aux_loss"), "attention_bias": False,
    }
    if config.head_dim is not None and family != "olmoe":
        fields["head_dim"] = config.head_dim
    if family == "mixtral":
        return {**fields, "num_local_experts": moe.num_experts, "intermediate_size": moe.ffn_hidden_size,
                "sliding_window": None, "router_jitter_noise": 0.0}
    fields.update(num_experts=moe.num_experts, norm_topk_prob=not moe.pre_softmax)
    if family == "olmoe":
        return {**fields, "intermediate_size": moe.ffn_hidden_size, "clip_qkv": None}
    return {
        **fields, "moe_intermediate_size": moe.ffn_hidden_size,
        "intermediate_size": config.ffn_hidden_size or moe.ffn_hidden_size, "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(config.num_layers) if not config.is_moe_layer(i)],
        "use_sliding_window": False, "sliding_window": None,
    }


def config_to_hf(
    config: MoETransformerConfig, family: str, dtype: torch.dtype, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ``config.json`` dict of ``config`` as a ``family`` model whose weights are ``dtype``.

    ``extra`` keys (token ids kept by ``from_pretrained``) are written as given.
    """
    if family not in ARCHITECTURES:
        raise ValueError(f"Unknown family {family!r}; choose one of {', '.join(FAMILIES)}.")
    problems = _check_common(config, family)
    if not problems:
        problems = _check_deepseek(config) if family == "deepseek_v3" else _check_softmax_router(config, family)
    _refuse(family, problems)
    hf = {
        "architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads, "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps, "initializer_range": config.init_std, "hidden_act": "silu",
        "tie_word_embeddings": config.tie_embeddings, "attention_dropout": 0.0, "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."), **_rope(config), **_family_fields(config, family),
    }
    return {**hf, **(extra or {})}
