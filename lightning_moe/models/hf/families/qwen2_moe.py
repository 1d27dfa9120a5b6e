"""Qwen2-MoE (``model_type`` ``qwen2_moe``, Qwen1.5-MoE / Qwen2-57B-A14B): whole models and their sparse-MoE blocks.

As ``transformers`` 5.25's ``modeling_qwen2_moe``: routed as Qwen3-MoE (softmax, top-k,
renormalised iff ``norm_topk_prob``, false by default), plus a shared expert of width
``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))`` (our
``shared_expert_gate``); biases on q/k/v (``qkv_bias``, true by default; our
``attention_bias``); no q/k norm; dense layers (width ``intermediate_size``) where
``mlp_only_layers`` or ``decoder_sparse_step`` say; the sliding window counts only with
``use_sliding_window`` and is refused where it binds.
"""

from __future__ import annotations

from typing import Any

from lightning_moe.layers.config import MoEConfig
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.fields import Fields
from lightning_moe.models.hf.registry import Family, register_family
from lightning_moe.models.hf.softmax_family import (
    qwen_moe_layers,
    refuse_qwen_sliding_window,
    softmax_fields,
    softmax_moe,
)
from lightning_moe.models.hf.weights import shared_mlp_sources

__all__ = ["QWEN2_MOE"]


def _moe(fields: Fields) -> MoEConfig:
    shared = {"shared_expert_ffn_hidden_size": int(fields["shared_expert_intermediate_size"]),
              "shared_expert_gate": True}
    return softmax_moe(fields, "moe_intermediate_size", renormalise=bool(fields["norm_topk_prob"]), shared=shared)


def _model(fields: Fields, common: dict[str, Any]) -> MoETransformerConfig:
    head_dim = fields.raw.get("head_dim")
    return MoETransformerConfig(
        **common, head_dim=None if head_dim is None else int(head_dim),
        ffn_hidden_size=int(fields["intermediate_size"]), qk_norm=False,
        moe=_moe(fields), moe_layer_freq=qwen_moe_layers(fields, common["num_layers"]),
    )


def _export_problems(config: MoETransformerConfig) -> list[str]:
    moe, problems = config.moe, []
    if moe.score_func != "softmax":
        problems.append(f"score_func={moe.score_func!r}, qwen2_moe routes with softmax")
    if moe.num_groups is not None or moe.expert_bias or moe.topk_scaling_factor not in (None, 1.0):
        problems.append("group-limited routing, expert bias and topk_scaling_factor do not exist in qwen2_moe")
    if not moe.shared_expert_ffn_hidden_size or not moe.shared_expert_gate:
        problems.append(
            f"shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}, shared_expert_gate="
            f"{moe.shared_expert_gate}: every qwen2_moe MoE layer has a shared expert with a sigmoid gate"
        )
    return problems


def _export_fields(config: MoETransformerConfig) -> dict[str, Any]:
    moe = config.moe
    return {
        **softmax_fields(config), "num_experts": moe.num_experts, "norm_topk_prob": not moe.pre_softmax,
        "moe_intermediate_size": moe.ffn_hidden_size,
        "shared_expert_intermediate_size": moe.shared_expert_ffn_hidden_size,
        "intermediate_size": config.ffn_hidden_size or moe.ffn_hidden_size, "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(config.num_layers) if not config.is_moe_layer(i)],
        "use_sliding_window": False, "sliding_window": None,
    }


QWEN2_MOE = register_family(Family(
    name="qwen2_moe", title="Qwen2-MoE", architecture="Qwen2MoeForCausalLM",
    defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10000.0,
              "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "router_aux_loss_coef": 0.001, "use_sliding_window": False, "sliding_window": 4096,
              "qkv_bias": True, "num_key_value_heads": 16},
    expert_count_keys=("num_experts",),
    moe_config=_moe, model_config=_model, refuse_model=refuse_qwen_sliding_window,
    attention="mha", qk_norm=None, attention_bias_key="qkv_bias", shared_expert_gate=True,
    export_problems=_export_problems, export_fields=_export_fields,
    block_class="Qwen2MoeSparseMoeBlock",
    block_weights={**shared_mlp_sources("shared_expert"), "shared_expert.gate.weight": "shared_expert_gate.weight"},
))
"""The Qwen2-MoE family, registered."""
