"""Mixtral (``model_type`` ``mixtral``): softmax, top-k, always renormalised; ``block_sparse_moe`` with ``w1/w3/w2``.

As ``transformers`` 5.24's ``modeling_mixtral``: no q/k norm, a sliding window refused where it
binds, ``router_jitter_noise`` refused (``transformers`` multiplies the experts' input by the
noise too). On disk the MoE block is ``block_sparse_moe`` and an expert's gate, up and down
projections are ``w1``, ``w3`` and ``w2``.
"""

from __future__ import annotations

from typing import Any

from lightning_moe.layers.config import MoEConfig
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.fields import Fields
from lightning_moe.models.hf.registry import Family, register_family
from lightning_moe.models.hf.softmax_family import (
    refuse_sliding_window,
    softmax_fields,
    softmax_moe,
    softmax_router_problems,
)

__all__ = ["MIXTRAL"]


def _moe(fields: Fields) -> MoEConfig:
    return softmax_moe(fields, "intermediate_size", renormalise=True)


def _refuse_moe(fields: Fields) -> None:
    if fields["router_jitter_noise"]:
        raise ValueError(
            f"router_jitter_noise={fields['router_jitter_noise']} is not supported (transformers multiplies "
            "the experts' input by the noise too); set it to 0.0 or use input_jitter_eps after loading."
        )


def _refuse_model(fields: Fields) -> None:
    refuse_sliding_window(fields, fields.raw.get("sliding_window"))


def _model(fields: Fields, common: dict[str, Any]) -> MoETransformerConfig:
    head_dim = fields.raw.get("head_dim")
    return MoETransformerConfig(
        **common, head_dim=None if head_dim is None else int(head_dim), ffn_hidden_size=None, qk_norm=False,
        moe=_moe(fields), moe_layer_freq=1,
    )


def _export_problems(config: MoETransformerConfig) -> list[str]:
    return softmax_router_problems(config, "mixtral", always_renormalises=True)


def _export_fields(config: MoETransformerConfig) -> dict[str, Any]:
    moe = config.moe
    return {**softmax_fields(config), "num_local_experts": moe.num_experts, "intermediate_size": moe.ffn_hidden_size,
            "sliding_window": None, "router_jitter_noise": 0.0}


MIXTRAL = register_family(Family(
    name="mixtral", title="Mixtral", architecture="MixtralForCausalLM",
    defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 1e6,
              "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "sliding_window": None,
              "head_dim": None, "num_key_value_heads": 8},
    expert_count_keys=("num_local_experts",),
    moe_config=_moe, refuse_moe=_refuse_moe, model_config=_model, refuse_model=_refuse_model,
    attention="mha", qk_norm=None, export_problems=_export_problems, export_fields=_export_fields,
    moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"),
    block_class="MixtralSparseMoeBlock",
))
"""The Mixtral family, registered."""
