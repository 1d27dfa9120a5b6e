"""GPT-OSS (``model_type`` ``gpt_oss``): biased router, top-k then softmax over the k, biased experts
with the clamped SwiGLU; attention sinks, alternating sliding-window and full attention, q/k/v/o biases.

As ``transformers`` 5.25's ``modeling_gpt_oss``:

* router ``mlp.router`` (``weight`` ``[E, H]`` and ``bias`` ``[E]``): the logits' top-k, softmax over
  the k chosen (our post-softmax routing, with ``router_bias``);
* experts ``mlp.experts``: ``gate_up_proj`` ``[E, H, 2F]`` whose columns interleave gate and up
  (gate ``[..., ::2]``, up ``[..., 1::2]``) with ``gate_up_proj_bias`` ``[E, 2F]`` likewise,
  ``down_proj`` ``[E, F, H]`` with ``down_proj_bias`` ``[E, H]``; the activation
  ``gate.clamp(max=limit) * sigmoid(alpha * gate) * (up.clamp(-limit, limit) + 1)`` (``swiglu_alpha``,
  ``swiglu_limit``); each expert's output, its down bias included, weighted by its routing weight
  (our ``fc2_bias``, scaled by the probability). On load the interleaved columns become our
  ``[gate ; up]`` rows (:func:`~lightning_moe.models.hf.weights.deinterleave`) and the projections are
  transposed to ``nn.Linear``'s (out, in); on save they are interleaved and transposed back;
* the published checkpoints store ``gate_up_proj`` and ``down_proj`` as MXFP4
  (``*_blocks`` + ``*_scales``, ``quantization_config.quant_method`` ``mxfp4``): dequantised on load
  (:mod:`lightning_moe.models.hf.mxfp4`), each rank reading only its experts' bytes; saving writes
  the dequantised tensors (a checkpoint ``transformers`` loads without quantisation).

The attention side maps onto ``MoETransformerConfig``'s fields: the one ``attention_bias`` switches
the q/k/v biases (``attention_bias``) and o_proj's (``attention_out_bias``); ``self_attn.sinks``
(``[heads]``) is ``attn.sinks`` (``attention_sinks``, always on); ``sliding_window`` and
``layer_types`` as written, or ``transformers``' alternation (sliding on even layers) when
``config.json`` has no ``layer_types``. Without ``rope_parameters`` or ``rope_scaling`` the rotary
embedding is ``GptOssConfig``'s YaRN (factor 32 from 4096 positions, ``truncate`` false).
"""

from __future__ import annotations

from typing import Any

from lightning_moe.layers.config import MoEConfig
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.fields import Fields, aux_loss
from lightning_moe.models.hf.registry import Family, register_family
from lightning_moe.models.hf.softmax_family import softmax_fields, softmax_router_problems

__all__ = ["GPT_OSS", "gpt_oss_moe_sources"]

_QUANT_METHODS = (None, "mxfp4")


def gpt_oss_moe_sources(layer: str, config: MoETransformerConfig | None = None) -> dict[str, Any]:
    """Where a GPT-OSS MoE block's tensors lie (:data:`~lightning_moe.models.hf.weights.Source`), by
    our key under ``ffn.``, for the block named ``layer`` (``model.layers.{i}.mlp``).

    ``fc1_weight`` is read as stored, ``[E, 2F, H]``; ``fc1_bias`` as ``[E, 2, F]``. An MXFP4
    checkpoint's ``*_blocks`` / ``*_scales`` pairs are found by name when the sources are resolved.
    """
    experts = f"{layer}.experts"
    return {
        "router.weight": f"{layer}.router.weight",
        "router.bias": f"{layer}.router.bias",
        "experts.fc1_weight": ("deinterleave", 1, ("transpose", 1, 2, f"{experts}.gate_up_proj")),
        "experts.fc1_bias": ("halves", 1, ("deinterleave", 1, f"{experts}.gate_up_proj_bias")),
        "experts.fc2_weight": ("transpose", 1, 2, f"{experts}.down_proj"),
        "experts.fc2_bias": f"{experts}.down_proj_bias",
    }


def _moe(fields: Fields) -> MoEConfig:
    return MoEConfig(
        hidden_size=int(fields["hidden_size"]), ffn_hidden_size=int(fields["intermediate_size"]),
        num_experts=fields.expert_count(), top_k=int(fields["num_experts_per_tok"]), score_func="softmax",
        pre_softmax=False, activation="clamped_swiglu", activation_alpha=float(fields["swiglu_alpha"]),
        activation_limit=float(fields["swiglu_limit"]), fc1_bias=True, fc2_bias=True, router_bias=True,
        init_std=float(fields["initializer_range"]), **aux_loss(fields["router_aux_loss_coef"]),
    )


def _refuse_moe(fields: Fields) -> None:
    quant = fields.raw.get("quantization_config") or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method not in _QUANT_METHODS:
        raise ValueError(
            f"quantization_config.quant_method={method!r} is not supported for gpt_oss; MXFP4 checkpoints "
            "(quant_method 'mxfp4') are dequantised on load, other quantisations are not."
        )


def _layer_types(fields: Fields, num_layers: int) -> list[str]:
    # transformers' default: sliding attention on even layers (0, 2, ...), full on odd ones.
    types = fields.raw.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    return list(types)


def _model(fields: Fields, common: dict[str, Any]) -> MoETransformerConfig:
    # One attention_bias switches the q/k/v biases (in common, Family.attention_bias_key) and o_proj's.
    return MoETransformerConfig(
        **common, head_dim=int(fields["head_dim"]), ffn_hidden_size=None, qk_norm=False,
        moe=_moe(fields), moe_layer_freq=1, attention_out_bias=common["attention_bias"], attention_sinks=True,
        sliding_window=fields["sliding_window"], layer_types=_layer_types(fields, common["num_layers"]),
    )


def _export_problems(config: MoETransformerConfig) -> list[str]:
    problems = softmax_router_problems(config, "gpt_oss", always_renormalises=True)
    moe = config.moe
    missing = [name for name in ("fc1_bias", "fc2_bias", "router_bias") if not getattr(moe, name)]
    if missing:
        problems.append(f"{', '.join(missing)} off: every gpt_oss router and expert has biases")
    if not getattr(config, "attention_sinks", False):
        problems.append("attention_sinks=False: every gpt_oss attention layer has sinks")
    if getattr(config, "attention_bias", False) != getattr(config, "attention_out_bias", False):
        problems.append("attention_bias and attention_out_bias differ: gpt_oss has one attention_bias for q/k/v/o")
    return problems


def _export_fields(config: MoETransformerConfig) -> dict[str, Any]:
    moe = config.moe
    fields = softmax_fields(config)
    fields.update({
        "num_local_experts": moe.num_experts, "intermediate_size": moe.ffn_hidden_size,
        "swiglu_alpha": moe.activation_alpha, "swiglu_limit": moe.activation_limit,
        "sliding_window": getattr(config, "sliding_window", None),
        "layer_types": getattr(config, "layer_types", None) or ["full_attention"] * config.num_layers,
        "head_dim": config.attention_head_dim, "output_router_logits": False,
    })
    return fields


GPT_OSS = register_family(Family(
    name="gpt_oss", title="GPT-OSS", architecture="GptOssForCausalLM",
    # rope_scaling: GptOssConfig's YaRN when config.json gives neither rope_parameters nor rope_scaling.
    defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 150000.0,
              "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 4096},
              "router_aux_loss_coef": 0.001, "sliding_window": 128, "head_dim": 64, "num_key_value_heads": 8,
              "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True, "intermediate_size": 2880,
              "num_local_experts": 128, "num_experts_per_tok": 4},
    expert_count_keys=("num_local_experts",),
    moe_config=_moe, refuse_moe=_refuse_moe, model_config=_model,
    attention="mha", qk_norm=None, attention_bias_key="attention_bias", export_problems=_export_problems, export_fields=_export_fields,
    moe_prefix="mlp", moe_sources=gpt_oss_moe_sources, expert_activation="clamped_swiglu", expert_biases=True,
    gpt_oss_attention=True,
))
"""The GPT-OSS family, registered."""
