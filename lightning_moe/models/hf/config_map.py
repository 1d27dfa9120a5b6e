"""Hugging Face ``config.json`` -> :class:`MoETransformerConfig`, for the four supported families.

Each family is mapped exactly as ``transformers`` 5.x builds it (its modeling files are the
reference; ``tests/models/test_hf_families.py`` compares the logits): anything this model
cannot reproduce (a binding sliding window, attention biases, q/k/v clipping, rope types other
than default and YaRN, quantised weights, another activation...) is refused with an error that
names the field, never silently approximated. Keys a published ``config.json`` may omit take the
defaults of ``transformers``' config classes. The reverse direction is :mod:`.config_export`.

Router semantics per family (``transformers`` 5.24, verified against its modeling files):

* Qwen3-MoE and OLMoE: softmax over all experts, top-k, renormalised iff ``norm_topk_prob``
  (= our post-softmax, or ``pre_softmax`` when not renormalised);
* Mixtral: softmax, top-k, always renormalised (our post-softmax);
* DeepSeek-V3: sigmoid scores, ``e_score_correction_bias`` added for selection only (our expert
  bias), groups scored by their top-2 biased scores, renormalised, times ``routed_scaling_factor``.
* Qwen2-MoE (MoE blocks only, :func:`moe_config_from_hf`; no whole-model loading): as Qwen3-MoE,
  plus a shared expert of width ``shared_expert_intermediate_size`` scaled by
  ``sigmoid(shared_expert_gate(x))`` (our ``shared_expert_gate``).

Training-only settings map where ``config.json`` carries them: ``router_aux_loss_coef`` to the
``aux_loss`` coefficient (Qwen3, Mixtral, OLMoE); DeepSeek's ``seq_aux`` / ``aux_loss_alpha`` to
``seq_aux_loss``; ``initializer_range`` to both ``init_std``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_moe.layers.config import MoEConfig
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.rope import RopeScaling

__all__ = ["ARCHITECTURES", "FAMILIES", "MOE_FAMILIES", "config_from_hf", "family_of", "moe_config_from_hf", "rope_from_hf"]

ARCHITECTURES = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
"""``model_type`` of each supported family -> the ``transformers`` class that loads it."""
FAMILIES = tuple(sorted(ARCHITECTURES))
MOE_FAMILIES = tuple(sorted((*ARCHITECTURES, "qwen2_moe")))
"""Families whose MoE block :func:`moe_config_from_hf` maps (whole models: :data:`FAMILIES`)."""

# transformers 5.24's defaults of the optional keys read below (a published config.json may omit them).
_COMMON_DEFAULTS = {
    "hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": False, "attention_bias": False,
    "attention_dropout": 0.0, "rope_scaling": None, "rope_parameters": None,
}
_DEFAULTS = {
    "qwen3_moe": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10000.0,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "router_aux_loss_coef": 0.001, "use_sliding_window": False, "sliding_window": None,
                  "head_dim": None, "num_key_value_heads": 4},
    "mixtral": {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 1e6,
                "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "sliding_window": None,
                "head_dim": None, "num_key_value_heads": 8},
    "olmoe": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "rope_theta": 10000.0,
              "norm_topk_prob": False, "router_aux_loss_coef": 0.01, "clip_qkv": None,
              "num_key_value_heads": None},
    "deepseek_v3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 10000.0,
                    "norm_topk_prob": True, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                    "n_shared_experts": 1, "first_k_dense_replace": 3, "rope_interleave": True,
                    "q_lora_rank": 1536, "num_key_value_heads": None, "seq_aux": False, "aux_loss_alpha": 0.0},
    "qwen2_moe": {"norm_topk_prob": False, "router_aux_loss_coef": 0.001},  # MoE keys only: no whole-model mapping
}
_EXPERT_COUNT_KEYS = {
    "qwen3_moe": ("num_experts", "num_local_experts"),
    "mixtral": ("num_local_experts",),
    "olmoe": ("num_experts",),
    "deepseek_v3": ("n_routed_experts", "num_local_experts"),
    "qwen2_moe": ("num_experts",),
}
# Keys whose presence means a feature this model does not implement.
_REFUSED_IF_SET = ("quantization_config",)


class _Fields:
    """``config.json`` read with the family's defaults; a missing required key is a clear error."""

    def __init__(self, raw: Mapping[str, Any], family: str) -> None:
        self.raw, self.family = raw, family
        self.defaults = {**_COMMON_DEFAULTS, **_DEFAULTS[family]}

    def __getitem__(self, key: str) -> Any:
        if key in self.raw:
            return self.raw[key]
        if key in self.defaults:
            return self.defaults[key]
        raise ValueError(f"config.json of this {self.family} model has no {key!r}, which the mapping needs.")

    def first(self, keys: tuple[str, ...]) -> Any:
        for key in keys:
            if self.raw.get(key) is not None:
                return self.raw[key]
        raise ValueError(f"config.json of this {self.family} model has none of {list(keys)}.")


def family_of(raw: Mapping[str, Any]) -> str:
    """The family of a ``config.json`` (its ``model_type``), or an error listing the supported ones."""
    family = raw.get("model_type")
    if family not in ARCHITECTURES:
        raise ValueError(
            f"model_type {family!r} is not supported; supported families: {', '.join(FAMILIES)} "
            "(Hugging Face model_type of Qwen3-MoE, Mixtral, OLMoE and DeepSeek-V3)."
        )
    return family


def rope_from_hf(fields: _Fields) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from ``rope_parameters`` (transformers 5) or ``rope_theta`` /
    ``rope_scaling`` (older files)."""
    params = fields["rope_parameters"] or fields["rope_scaling"] or {}
    theta = params.get("rope_theta", fields["rope_theta"])
    kind = params.get("rope_type") or params.get("type") or "default"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial_rotary_factor={params['partial_rotary_factor']} is not supported: rotary embeddings "
            "cover the whole head here."
        )
    if kind == "default":
        return float(theta), None
    if kind != "yarn":
        raise ValueError(f"rope_type {kind!r} is not supported; supported rope types: default, yarn.")
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("rope_type 'yarn' needs original_max_position_embeddings in the rope parameters.")
    factor = params.get("factor") or fields["max_position_embeddings"] / original
    return float(theta), RopeScaling(
        factor=float(factor), original_max_seq_len=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
    )


def _refuse_unsupported_moe(fields: _Fields) -> None:
    """Refuse what the MoE block of ``fields`` does that a `MoELayer` cannot reproduce exactly."""
    raw, family = fields.raw, fields.family
    for key in _REFUSED_IF_SET:
        if raw.get(key):
            raise ValueError(
                f"{key} {raw[key]} is set: quantised checkpoints are not supported; dequantize the weights "
                "(e.g. DeepSeek's fp8_cast_bf16.py) and drop quantization_config first."
            )
    if fields["hidden_act"] != "silu":
        raise ValueError(
            f"hidden_act={fields['hidden_act']!r} is not supported: the experts are SwiGLU (silu)."
        )
    if family == "mixtral" and fields["router_jitter_noise"]:
        raise ValueError(
            f"router_jitter_noise={fields['router_jitter_noise']} is not supported (transformers multiplies "
            "the experts' input by the noise too); set it to 0.0 or use input_jitter_eps after loading."
        )


def _refuse_unsupported(fields: _Fields) -> None:
    raw, family = fields.raw, fields.family
    _refuse_unsupported_moe(fields)
    if fields["attention_bias"]:
        raise ValueError("attention_bias=True is not supported: the attention projections have no biases.")
    if fields["attention_dropout"]:
        raise ValueError(f"attention_dropout={fields['attention_dropout']} is not supported (no dropout here).")
    window = raw.get("sliding_window")
    if family == "qwen3_moe" and not raw.get("use_sliding_window", False):
        window = None  # transformers ignores the window unless use_sliding_window
    if family in ("qwen3_moe", "mixtral") and window is not None and window < fields["max_position_embeddings"]:
        raise ValueError(
            f"sliding_window={window} (below max_position_embeddings={fields['max_position_embeddings']}) is "
            "not supported: attention is full causal here. Use a model without a sliding window."
        )
    if family == "olmoe" and fields["clip_qkv"] is not None:
        raise ValueError(f"clip_qkv={fields['clip_qkv']} is not supported (no q/k/v clipping here).")


def _aux_loss(coeff: float) -> dict[str, Any]:
    return {"load_balancing": ["aux_loss"], "aux_loss_coeff": float(coeff)} if coeff else {}


def _softmax_moe(fields: _Fields, hidden: int, ffn_key: str) -> MoEConfig:
    family = fields.family
    renormalise = True if family == "mixtral" else bool(fields["norm_topk_prob"])
    shared = {}
    if family == "qwen2_moe":
        shared = {"shared_expert_ffn_hidden_size": int(fields["shared_expert_intermediate_size"]),
                  "shared_expert_gate": True}
    return MoEConfig(
        hidden_size=hidden, ffn_hidden_size=int(fields[ffn_key]),
        num_experts=int(fields.first(_EXPERT_COUNT_KEYS[family])),
        top_k=int(fields["num_experts_per_tok"]), score_func="softmax", pre_softmax=not renormalise,
        init_std=float(fields["initializer_range"]), **shared, **_aux_loss(fields["router_aux_loss_coef"]),
    )


def moe_config_from_hf(raw: Mapping[str, Any], family: str) -> MoEConfig:
    """The :class:`MoEConfig` of the sparse-MoE blocks of a ``family`` model with ``config.json`` ``raw``.

    The routing is exactly ``transformers``' (module docstring); a setting of the block that a
    `MoELayer` cannot reproduce is refused with an error naming it. Training losses map as in
    :func:`config_from_hf`. ``family`` is one of :data:`MOE_FAMILIES`.
    """
    if family not in MOE_FAMILIES:
        raise ValueError(f"No MoE block mapping for family {family!r}; supported: {', '.join(MOE_FAMILIES)}.")
    fields = _Fields(raw, family)
    _refuse_unsupported_moe(fields)
    hidden = int(fields["hidden_size"])
    if family == "deepseek_v3":
        return _deepseek_moe(fields, hidden)
    return _softmax_moe(fields, hidden, "intermediate_size" if family in ("mixtral", "olmoe") else "moe_intermediate_size")


def _deepseek_moe(fields: _Fields, hidden: int) -> MoEConfig:
    top_k, experts = int(fields["num_experts_per_tok"]), int(fields.first(_EXPERT_COUNT_KEYS["deepseek_v3"]))
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
        hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, top_k=top_k, score_func="sigmoid",
        num_groups=groups, group_top_k=group_top_k, topk_scaling_factor=None if scaling == 1.0 else scaling,
        expert_bias=True, shared_expert_ffn_hidden_size=shared * ffn or None,
        init_std=float(fields["initializer_range"]), **balancing,
    )


def _qwen3_layers(fields: _Fields, num_layers: int) -> int | list[int]:
    dense = set(fields["mlp_only_layers"] or [])
    step = int(fields["decoder_sparse_step"])
    flags = [int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]
    return 1 if all(flags) else flags


def config_from_hf(raw: Mapping[str, Any]) -> tuple[MoETransformerConfig, str]:
    """``(config, family)`` of a Hugging Face ``config.json`` dict; refuses what cannot be exact."""
    family = family_of(raw)
    fields = _Fields(raw, family)
    _refuse_unsupported(fields)
    theta, scaling = rope_from_hf(fields)
    hidden, heads = int(fields["hidden_size"]), int(fields["num_attention_heads"])
    num_layers = int(fields["num_hidden_layers"])
    kv_heads = fields["num_key_value_heads"]
    common = dict(
        vocab_size=int(fields["vocab_size"]), hidden_size=hidden, num_layers=num_layers,
        num_attention_heads=heads,
        num_kv_heads=None if kv_heads in (None, heads) else int(kv_heads),
        max_seq_len=int(fields["max_position_embeddings"]), rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(fields["rms_norm_eps"]), tie_embeddings=bool(fields["tie_word_embeddings"]),
        init_std=float(fields["initializer_range"]),
    )
    if family == "deepseek_v3":
        if common["num_kv_heads"] is not None:
            raise ValueError(
                f"num_key_value_heads={kv_heads} differs from num_attention_heads={heads}: multi-head latent "
                "attention has one key/value per head."
            )
        config = MoETransformerConfig(
            **common, ffn_hidden_size=int(fields["intermediate_size"]), attention="mla",
            q_lora_rank=fields["q_lora_rank"], kv_lora_rank=int(fields["kv_lora_rank"]),
            qk_nope_head_dim=int(fields["qk_nope_head_dim"]), qk_rope_head_dim=int(fields["qk_rope_head_dim"]),
            v_head_dim=int(fields["v_head_dim"]), rope_interleaved=bool(fields["rope_interleave"]),
            first_dense_layers=int(fields["first_k_dense_replace"]), moe=moe_config_from_hf(raw, family),
        )
        return config, family
    head_dim = raw.get("head_dim")
    if family == "olmoe" and head_dim not in (None, hidden // heads):
        raise ValueError(
            f"OLMoE with head_dim={head_dim} != hidden_size / num_attention_heads is not supported."
        )
    moe = moe_config_from_hf(raw, family)
    config = MoETransformerConfig(
        **common, head_dim=None if family == "olmoe" or head_dim is None else int(head_dim),
        ffn_hidden_size=int(fields["intermediate_size"]) if family == "qwen3_moe" else None,
        qk_norm={"qwen3_moe": True, "olmoe": "full", "mixtral": False}[family],
        moe=moe, moe_layer_freq=_qwen3_layers(fields, num_layers) if family == "qwen3_moe" else 1,
    )
    return config, family
