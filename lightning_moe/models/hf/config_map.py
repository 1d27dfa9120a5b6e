"""Hugging Face ``config.json`` -> :class:`MoETransformerConfig`, for the registered families.

Each family is mapped exactly as ``transformers`` 5.x builds it (its modeling files are the
reference; ``tests/models/test_hf_families.py`` compares the logits): anything this model
cannot reproduce (a binding sliding window outside GPT-OSS, attention biases or partial rotary
where the family's code has none, q/k/v clipping, rope types other than default and YaRN,
quantised weights other than MXFP4, another activation...) is refused with an error that names
the field, never silently approximated. Keys a published ``config.json`` may omit take the
defaults of ``transformers``' config classes. The reverse direction is :mod:`.config_export`.

This module holds what every family shares (the common keys, rope, the common refusals); each
family's routing, defaults and quirks are its own file in :mod:`lightning_moe.models.hf.families`
(:class:`~lightning_moe.models.hf.registry.Family`). Training-only settings map where
``config.json`` carries them: ``router_aux_loss_coef`` to the ``aux_loss`` coefficient (Qwen2,
Qwen3, Mixtral, OLMoE); DeepSeek's ``seq_aux`` / ``aux_loss_alpha`` to ``seq_aux_loss``;
``initializer_range`` to both ``init_std``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning_moe.models.hf.families  # noqa: F401  (registers the built-in families)
from lightning_moe.layers.config import MoEConfig
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.fields import Fields
from lightning_moe.models.hf.registry import FAMILIES as _REGISTERED
from lightning_moe.models.hf.registry import family as _family
from lightning_moe.models.hf.registry import model_families, moe_families
from lightning_moe.models.rope import RopeScaling

__all__ = [
    "ARCHITECTURES", "FAMILIES", "MOE_FAMILIES", "config_from_hf", "family_of", "moe_config_from_hf",
    "partial_rotary_from_hf", "rope_from_hf",
]

FAMILIES = model_families()
"""The built-in families whose whole models load and save (sorted); the mappings below read the
registry itself, so a family registered later is supported too."""
MOE_FAMILIES = moe_families()
"""Built-in families whose MoE block :func:`moe_config_from_hf` maps (whole models: :data:`FAMILIES`)."""
ARCHITECTURES = {name: _REGISTERED[name].architecture for name in FAMILIES}
"""``model_type`` of each built-in family -> the ``transformers`` class that loads it."""

# Keys whose presence means a feature this model does not implement.
_REFUSED_IF_SET = ("quantization_config",)


def family_of(raw: Mapping[str, Any]) -> str:
    """The family of a ``config.json`` (its ``model_type``, or a family's alias of it such as Kimi K2's
    ``kimi_k2``), or an error listing the supported ones."""
    family, supported = raw.get("model_type"), model_families()
    aliases = {alias: name for name in supported for alias in _REGISTERED[name].model_type_aliases}
    family = aliases.get(family, family)
    if family not in supported:
        titles = [_REGISTERED[name].title for name in supported]
        raise ValueError(
            f"model_type {family!r} is not supported; supported families: {', '.join(supported)} "
            f"(Hugging Face model_type of {', '.join(titles[:-1])} and {titles[-1]})."
        )
    return family


def rope_from_hf(fields: Fields) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from ``rope_parameters`` (transformers 5) or ``rope_theta`` /
    ``rope_scaling`` (older files)."""
    params = fields["rope_parameters"] or fields["rope_scaling"] or {}
    theta = params.get("rope_theta", fields["rope_theta"])
    kind = params.get("rope_type") or params.get("type") or "default"
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


def partial_rotary_from_hf(fields: Fields) -> float:
    """The fraction of each head the rotary embedding covers, found where ``transformers`` looks:
    ``rope_parameters``, then the top-level ``partial_rotary_factor``, then the family's default
    (GLM-4.5: 0.5, else 1.0); a factor below 1 is refused for a family whose ``transformers``
    code rotates the whole head."""
    params = fields["rope_parameters"] or fields["rope_scaling"] or {}
    factor = params.get("partial_rotary_factor")
    if factor is None:
        factor = fields["partial_rotary_factor"]
    factor = float(factor)
    if factor != 1.0 and not fields.spec.partial_rotary:
        raise ValueError(
            f"partial_rotary_factor={factor} is not supported for {fields.spec.title}: its attention rotates "
            "the whole head. Remove it from config.json, or use a family with partial rotary (glm4_moe)."
        )
    return factor


def _dequantised_on_load(quantization: Any) -> bool:
    """MXFP4 (GPT-OSS's experts, ``name_blocks`` + ``name_scales``) is dequantised when the weights are read."""
    return isinstance(quantization, Mapping) and quantization.get("quant_method") == "mxfp4"


def _refuse_unsupported_moe(fields: Fields) -> None:
    """Refuse what the MoE block of ``fields`` does that a `MoELayer` cannot reproduce exactly."""
    raw = fields.raw
    for key in _REFUSED_IF_SET:
        if raw.get(key) and not _dequantised_on_load(raw[key]):
            raise ValueError(
                f"{key} {raw[key]} is set: quantised checkpoints are not supported; dequantize the weights "
                "(e.g. DeepSeek's fp8_cast_bf16.py) and drop quantization_config first."
            )
    if fields["hidden_act"] != "silu":
        raise ValueError(
            f"hidden_act={fields['hidden_act']!r} is not supported: the experts are SwiGLU (silu)."
        )
    fields.spec.refuse_moe(fields)


def _refuse_unsupported(fields: Fields) -> None:
    _refuse_unsupported_moe(fields)
    if fields.spec.attention_bias_key is None and fields["attention_bias"]:
        raise ValueError(
            f"attention_bias=True is not supported for {fields.spec.title}: its attention projections have no "
            "biases in transformers' code."
        )
    if fields["attention_dropout"]:
        raise ValueError(f"attention_dropout={fields['attention_dropout']} is not supported (no dropout here).")
    fields.spec.refuse_model(fields)


def moe_config_from_hf(raw: Mapping[str, Any], family: str) -> MoEConfig:
    """The :class:`MoEConfig` of the sparse-MoE blocks of a ``family`` model with ``config.json`` ``raw``.

    The routing is exactly ``transformers``' (module docstring); a setting of the block that a
    `MoELayer` cannot reproduce is refused with an error naming it. Training losses map as in
    :func:`config_from_hf`. ``family`` is one of :data:`MOE_FAMILIES`.
    """
    if family not in moe_families():
        raise ValueError(f"No MoE block mapping for family {family!r}; supported: {', '.join(moe_families())}.")
    fields = Fields(raw, _family(family))
    _refuse_unsupported_moe(fields)
    return fields.spec.moe_config(fields)


def config_from_hf(raw: Mapping[str, Any]) -> tuple[MoETransformerConfig, str]:
    """``(config, family)`` of a Hugging Face ``config.json`` dict; refuses what cannot be exact."""
    family = family_of(raw)
    fields = Fields(raw, _family(family))
    _refuse_unsupported(fields)
    theta, scaling = rope_from_hf(fields)
    heads = int(fields["num_attention_heads"])
    kv_heads = fields["num_key_value_heads"]
    common = dict(
        vocab_size=int(fields["vocab_size"]), hidden_size=int(fields["hidden_size"]),
        num_layers=int(fields["num_hidden_layers"]), num_attention_heads=heads,
        num_kv_heads=None if kv_heads in (None, heads) else int(kv_heads),
        max_seq_len=int(fields["max_position_embeddings"]), rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(fields["rms_norm_eps"]), tie_embeddings=bool(fields["tie_word_embeddings"]),
        init_std=float(fields["initializer_range"]), partial_rotary_factor=partial_rotary_from_hf(fields),
        attention_bias=bool(fields[fields.spec.attention_bias_key]) if fields.spec.attention_bias_key else False,
    )
    return fields.spec.model_config(fields, common), family
