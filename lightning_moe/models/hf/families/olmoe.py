"""OLMoE (``model_type`` ``olmoe``): routed as Qwen3-MoE; q/k norm over the whole projection.

As ``transformers`` 5.24's ``modeling_olmoe``: ``head_dim`` is always ``hidden_size /
num_attention_heads`` (another one is refused), ``clip_qkv`` is refused.
"""

from __future__ import annotations

from typing import Any

from lightning_moe.layers.config import MoEConfig
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.fields import Fields
from lightning_moe.models.hf.registry import Family, register_family
from lightning_moe.models.hf.softmax_family import softmax_fields, softmax_moe, softmax_router_problems

__all__ = ["OLMOE"]


def _moe(fields: Fields) -> MoEConfig:
    return softmax_moe(fields, "intermediate_size", renormalise=bool(fields["norm_topk_prob"]))


def _refuse_model(fields: Fields) -> None:
    if fields["clip_qkv"] is not None:
        raise ValueError(f"clip_qkv={fields['clip_qkv']} is not supported (no q/k/v clipping here).")


def _model(fields: Fields, common: dict[str, Any]) -> MoETransformerConfig:
    head_dim = fields.raw.get("head_dim")
    if head_dim not in (None, common["hidden_size"] // common["num_attention_heads"]):
        raise ValueError(
            f"OLMoE with head_dim={head_dim} != hidden_size / num_attention_heads is not supported."
        )
    return MoETransformerConfig(
        **common, head_dim=None, ffn_hidden_size=None, qk_norm="full", moe=_moe(fields), moe_layer_freq=1,
    )


def _export_problems(config: MoETransformerConfig) -> list[str]:
    problems = softmax_router_problems(config, "olmoe")
    if config.head_dim not in (None, config.hidden_size // config.num_attention_heads):
        problems.append(f"head_dim={config.head_dim}: olmoe derives it as hidden_size / num_attention_heads")
    return problems


def _export_fields(config: MoETransformerConfig) -> dict[str, Any]:
    moe = config.moe
    return {**softmax_fields(config, head_dim=False), "num_experts": moe.num_experts,
            "norm_topk_prob": not moe.pre_softmax, "intermediate_size": moe.ffn_hidden_size, "clip_qkv": None}


OLMOE = register_family(Family(
    name="olmoe", title="OLMoE", architecture="OlmoeForCausalLM",
    defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "rope_theta": 10000.0,
              "norm_topk_prob": False, "router_aux_loss_coef": 0.01, "clip_qkv": None,
              "num_key_value_heads": None},
    expert_count_keys=("num_experts",),
    moe_config=_moe, model_config=_model, refuse_model=_refuse_model,
    attention="mha", qk_norm="full", export_problems=_export_problems, export_fields=_export_fields,
    block_class="OlmoeSparseMoeBlock",
))
"""The OLMoE family, registered."""
