"""What the sigmoid-routed families (DeepSeek-V3 / Kimi K2, GLM-4.5) share, used by their files.

Their routers are ``transformers``' DeepSeek-V3 router: sigmoid scores, ``e_score_correction_bias``
added for selection only (our expert bias), groups scored by their top-2 biased scores, the
chosen scores renormalised, times ``routed_scaling_factor``; ``n_shared_experts`` ungated shared
experts of width ``moe_intermediate_size``; the first ``first_k_dense_replace`` layers dense.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_moe.layers.config import MoEConfig
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.fields import Fields

__all__ = ["sigmoid_fields", "sigmoid_moe", "sigmoid_router_problems", "zero_score_bias"]


def sigmoid_moe(fields: Fields, balancing: dict[str, Any] | None = None) -> MoEConfig:
    """The :class:`MoEConfig` of a DeepSeek-V3-style block from ``fields``; ``balancing``: the
    family's load-balancing keyword arguments (none by default)."""
    title = fields.spec.title
    top_k, experts = int(fields["num_experts_per_tok"]), fields.expert_count()
    if not fields["norm_topk_prob"] or top_k < 2:
        raise ValueError(
            f"{title} with norm_topk_prob={fields['norm_topk_prob']} and num_experts_per_tok={top_k} is "
            "not supported: sigmoid routing here renormalises the top-k weights, which needs norm_topk_prob=true "
            "and at least 2 experts per token."
        )
    groups, group_top_k = fields["n_group"], fields["topk_group"]
    if not groups or groups == 1 or group_top_k == groups:
        groups = group_top_k = None  # every group selected: plain top-k
    elif top_k // group_top_k != 2:
        raise ValueError(
            f"transformers' {title} scores each expert group by its top 2 experts; this router scores it "
            f"by num_experts_per_tok // topk_group = {top_k} // {group_top_k} = {top_k // group_top_k}. "
            "Supported: num_experts_per_tok // topk_group == 2 (DeepSeek-V3: 8 // 4), n_group 1 or "
            "topk_group == n_group."
        )
    ffn, shared = int(fields["moe_intermediate_size"]), int(fields["n_shared_experts"] or 0)
    scaling = float(fields["routed_scaling_factor"])
    return MoEConfig(
        hidden_size=int(fields["hidden_size"]), ffn_hidden_size=ffn, num_experts=experts, top_k=top_k,
        score_func="sigmoid", num_groups=groups, group_top_k=group_top_k,
        topk_scaling_factor=None if scaling == 1.0 else scaling,
        expert_bias=True, shared_expert_ffn_hidden_size=shared * ffn or None,
        init_std=float(fields["initializer_range"]), **(balancing or {}),
    )


def sigmoid_router_problems(config: MoETransformerConfig, family: str) -> list[str]:
    """What of ``config``'s routing and layer pattern the sigmoid ``family`` cannot hold."""
    moe, problems = config.moe, []
    if moe.score_func != "sigmoid" or moe.top_k < 2:
        problems.append(
            f"score_func={moe.score_func!r} with top_k={moe.top_k}: {family} renormalises sigmoid scores "
            "over at least 2 experts"
        )
    if moe.num_groups is not None and moe.group_top_k != moe.num_groups and moe.top_k // moe.group_top_k != 2:
        problems.append(
            f"top_k // group_top_k = {moe.top_k // moe.group_top_k}: {family} scores groups by their "
            "top 2 experts"
        )
    shared = moe.shared_expert_ffn_hidden_size or 0
    if not shared or shared % moe.ffn_hidden_size:
        problems.append(
            f"shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}: {family} has "
            f"n_shared_experts >= 1 shared experts of width moe_intermediate_size={moe.ffn_hidden_size}"
        )
    expected = [i >= config.first_dense_layers for i in range(config.num_layers)]
    if [config.is_moe_layer(i) for i in range(config.num_layers)] != expected:
        problems.append(
            f"{family}'s dense layers are the first first_k_dense_replace ones, every later one is MoE"
        )
    return problems


def sigmoid_fields(config: MoETransformerConfig) -> dict[str, Any]:
    """The ``config.json`` keys of the routing and layer pattern every sigmoid family writes alike."""
    moe = config.moe
    return {
        "intermediate_size": config.ffn_hidden_size or moe.ffn_hidden_size,
        "moe_intermediate_size": moe.ffn_hidden_size, "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k, "n_group": moe.num_groups or 1,
        "topk_group": moe.group_top_k or 1,
        "routed_scaling_factor": moe.topk_scaling_factor or 1.0, "norm_topk_prob": True,
        "n_shared_experts": moe.shared_expert_ffn_hidden_size // moe.ffn_hidden_size,
        "first_k_dense_replace": config.first_dense_layers,
    }


def zero_score_bias(names: set[str], config: MoETransformerConfig) -> dict[str, Tensor]:
    """The score-correction bias ``transformers`` always has, as zeros (they select as no bias does),
    for the MoE layers whose bias is not among ``names``."""
    out = {}
    for index in config.moe_layers:
        name = f"model.layers.{index}.mlp.gate.e_score_correction_bias"
        if name not in names:
            out[name] = torch.zeros(config.moe.num_experts, dtype=torch.float32)
    return out
