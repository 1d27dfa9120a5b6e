""":class:`MoETransformerConfig` -> Hugging Face ``config.json`` of one family (reverse of :mod:`.config_map`).

:func:`infer_family` picks the first registered family that holds a config (MLA: DeepSeek-V3; q/k
norm over the whole projection: OLMoE; per head: Qwen3-MoE; none: Mixtral; a gated shared expert
and q/k/v biases: Qwen2-MoE; sigmoid routing or partial rotary with multi-head attention: GLM-4.5; the clamped SwiGLU:
GPT-OSS);
:func:`config_to_hf` checks that the family's ``transformers`` implementation computes exactly
this model and refuses, naming the setting, whatever it cannot hold (a shared expert in Mixtral,
sigmoid scores in Qwen3, q/k/v biases in OLMoE...).
Both the ``transformers`` 5 keys (``rope_parameters``) and the older ones (``rope_theta``,
``rope_scaling``) are written, so earlier ``transformers`` versions read the rotary settings too.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.registry import FAMILIES, Family, model_families
from lightning_moe.models.hf.registry import family as _family

__all__ = ["PASSTHROUGH_KEYS", "config_to_hf", "infer_family"]

PASSTHROUGH_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""``config.json`` keys this model does not use but keeps from ``from_pretrained`` to ``save_pretrained``."""


def infer_family(config: MoETransformerConfig) -> str:
    """The family ``config`` is written as when none is named: the first registered whole-model family
    whose attention matches ``config`` (same type and, for multi-head attention, a q/k norm it can
    apply) and whose experts use ``config``'s activation where the family has its own (GPT-OSS's
    clamped SwiGLU), and which holds all of ``config`` (:func:`config_to_hf` finds no problem);
    when none holds it all, the first that matches (:func:`config_to_hf` then says what it cannot hold)."""
    activation = config.moe.activation if config.moe is not None else None
    matching = [
        spec for spec in FAMILIES.values()
        if spec.whole_model and spec.attention == config.attention
        and (spec.attention == "mla" or spec.computes_qk_norm(config.qk_norm_mode))
        and (spec.expert_activation == "swiglu" or activation == spec.expert_activation)
    ]
    for spec in matching:
        if not _problems(config, spec):
            return spec.name
    if matching:
        return matching[0].name
    raise ValueError(
        f"No Hugging Face family computes attention={config.attention!r} with qk_norm={config.qk_norm!r}; "
        f"supported families: {', '.join(model_families())}."
    )


def _refuse(family: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(
            f"This model cannot be written as a Hugging Face {family} model: {'; '.join(problems)}. "
            f"Supported families: {', '.join(model_families())} (save_pretrained(path, family=...))."
        )


def _check_common(config: MoETransformerConfig, spec: Family) -> list[str]:
    moe, name = config.moe, spec.name
    problems = []
    if moe is None:
        return [f"a dense model (moe=None) has no {name} form"]
    if moe.activation != spec.expert_activation:
        problems.append(f"experts use activation={moe.activation!r}, {name} uses {spec.expert_activation!r}")
    if not spec.expert_biases:
        for bias in ("fc1_bias", "fc2_bias", "router_bias"):
            if getattr(moe, bias):
                problems.append(f"{bias}=True: {name} {'router' if bias == 'router_bias' else 'experts'} have no bias")
    if moe.shared_expert_gate and not spec.shared_expert_gate:
        problems.append(f"shared_expert_gate=True: {name} has no shared-expert gate")
    if config.attention != spec.attention:
        problems.append(f"attention={config.attention!r}, {name} uses {spec.attention!r}")
    if config.attention == "mha" and not spec.computes_qk_norm(config.qk_norm_mode):
        problems.append(f"qk_norm={config.qk_norm!r}, {name} uses {spec.qk_norm or 'none'}")
    if config.attention_bias and spec.attention_bias_key is None:
        problems.append(f"attention_bias=True: {name} has no q/k/v biases")
    if config.partial_rotary_factor != 1.0 and not spec.partial_rotary:
        problems.append(f"partial_rotary_factor={config.partial_rotary_factor}: {name} rotates the whole head")
    if not spec.interleaved_rope and config.rope_interleaved:
        problems.append(f"rope_interleaved=True: {name} rotates halves")
    if not spec.gpt_oss_attention:
        # transformers would drop these tensors (or the window, which lives in config.json only) with a warning.
        problems += [f"{flag}=True: {name} has no {what}" for flag, what in
                     (("attention_sinks", "attention sinks"), ("attention_out_bias", "o_proj bias"))
                     if getattr(config, flag)]
        if config.layer_types is not None and "sliding_attention" in config.layer_types:
            problems.append(f"sliding-window layers (layer_types, sliding_window={config.sliding_window}): the {name} "
                            "export writes every layer as full attention")
    return problems


def _rope(config: MoETransformerConfig) -> dict[str, Any]:
    scaling = config.rope_scaling
    # Only a family with partial rotary gets here with a factor below 1 (_check_common).
    partial = {} if config.partial_rotary_factor == 1.0 else {"partial_rotary_factor": config.partial_rotary_factor}
    if scaling is None:
        return {"rope_theta": config.rope_theta, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta, **partial}}
    params = {"rope_type": "yarn", "factor": scaling.factor,
              "original_max_position_embeddings": scaling.original_max_seq_len,
              "beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow, "truncate": scaling.truncate}
    for name in ("mscale", "mscale_all_dim", "attention_factor"):
        if getattr(scaling, name) is not None:
            params[name] = getattr(scaling, name)
    return {"rope_theta": config.rope_theta, "rope_scaling": {**params, "type": "yarn"},
            "rope_parameters": {**params, "rope_theta": config.rope_theta, **partial}}


def _problems(config: MoETransformerConfig, spec: Family) -> list[str]:
    """What of ``config`` the family ``spec`` cannot hold (empty: it can)."""
    return _check_common(config, spec) or spec.export_problems(config)


def config_to_hf(
    config: MoETransformerConfig, family: str, dtype: torch.dtype, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ``config.json`` dict of ``config`` as a ``family`` model whose weights are ``dtype``.

    ``extra`` keys (token ids kept by ``from_pretrained``) are written as given.
    """
    if family not in model_families():
        raise ValueError(f"Unknown family {family!r}; choose one of {', '.join(model_families())}.")
    spec = _family(family)
    _refuse(family, _problems(config, spec))
    hf = {
        "architectures": [spec.architecture], "model_type": family, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads, "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps, "initializer_range": config.init_std, "hidden_act": "silu",
        "tie_word_embeddings": config.tie_embeddings, "attention_dropout": 0.0, "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."), **_rope(config), **spec.export_fields(config),
    }
    if spec.attention_bias_key is not None:
        hf[spec.attention_bias_key] = config.attention_bias
    return {**hf, **(extra or {})}
