"""Qwen3-MoE (``model_type`` ``qwen3_moe``): softmax, top-k, renormalised iff ``norm_topk_prob``; q/k norm per head.

As ``transformers`` 5.24's ``modeling_qwen3_moe``: dense layers where ``mlp_only_layers`` or
``decoder_sparse_step`` say (their width ``intermediate_size``, the experts'
``moe_intermediate_size``); the sliding window counts only with ``use_sliding_window`` and is
refused where it binds.
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
    softmax_router_problems,
)

__all__ = ["QWEN3_MOE"]


def _moe(fields: Fields) -> MoEConfig:
    return softmax_moe(fields, "moe_intermediate_size", renormalise=bool(fields["norm_topk_prob"]))


def _model(fields: Fields, common: dict[str, Any]) -> MoETransformerConfig:
    head_dim = fields.raw.get("head_dim")
    return MoETransformerConfig(
        **common, head_dim=None if head_dim is None else int(head_dim),
        ffn_hidden_size=int(fields["intermediate_size"]), qk_norm=True,
        moe=_moe(fields), moe_layer_freq=qwen_moe_layers(fields, common["num_layers"]),
    )


def _export_problems(config: MoETransformerConfig) -> list[str]:
    return softmax_router_problems(config, "qwen3_moe", dense_layers=True)


def _export_fields(config: MoETransformerConfig) -> dict[str, Any]:
    moe = config.moe
    return {
        **softmax_fields(config), "num_experts": moe.num_experts, "norm_topk_prob": not moe.pre_softmax,
        "moe_intermediate_size": moe.ffn_hidden_size,
        "intermediate_size": config.ffn_hidden_size or moe.ffn_hidden_size, "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(config.num_layers) if not config.is_moe_layer(i)],
        "use_sliding_window": False, "sliding_window": None,
    }


QWEN3_MOE = register_family(Family(
    name="qwen3_moe", title="Qwen3-MoE", architecture="Qwen3MoeForCausalLM",
    defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10000.0,
              "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "router_aux_loss_coef": 0.001, "use_sliding_window": False, "sliding_window": None,
              "head_dim": None, "num_key_value_heads": 4},
    expert_count_keys=("num_experts", "num_local_experts"),
    moe_config=_moe, model_config=_model, refuse_model=refuse_qwen_sliding_window,
    attention="mha", qk_norm="head", export_problems=_export_problems, export_fields=_export_fields,
    block_class="Qwen3MoeSparseMoeBlock",
))
"""The Qwen3-MoE family, registered."""
