"""What the softmax-routed families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) share, used by their files.

Their routers are all softmax over every expert then top-k, renormalised or not; their
``config.json`` differ only in key names and a few quirks, which each family's file gives.
"""

from __future__ import annotations

from typing import Any

from lightning_moe.layers.config import MoEConfig
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.fields import Fields, aux_loss

__all__ = [
    "qwen_moe_layers", "refuse_qwen_sliding_window", "refuse_sliding_window", "softmax_fields", "softmax_moe",
    "softmax_router_problems",
]


def softmax_moe(fields: Fields, ffn_key: str, renormalise: bool, shared: dict[str, Any] | None = None) -> MoEConfig:
    """The :class:`MoEConfig` of a softmax, top-k block whose experts are ``fields[ffn_key]`` wide;
    ``renormalise``: the top-k probabilities are renormalised (our post-softmax)."""
    return MoEConfig(
        hidden_size=int(fields["hidden_size"]), ffn_hidden_size=int(fields[ffn_key]),
        num_experts=fields.expert_count(),
        top_k=int(fields["num_experts_per_tok"]), score_func="softmax", pre_softmax=not renormalise,
        init_std=float(fields["initializer_range"]), **(shared or {}), **aux_loss(fields["router_aux_loss_coef"]),
    )


def refuse_sliding_window(fields: Fields, window: int | None) -> None:
    """Refuse a ``window`` that binds (below ``max_position_embeddings``): this family's mapping reads
    no window (only GPT-OSS's ``layer_types`` are mapped to sliding-window layers)."""
    if window is not None and window < fields["max_position_embeddings"]:
        raise ValueError(
            f"sliding_window={window} (below max_position_embeddings={fields['max_position_embeddings']}) is "
            f"not supported for {fields.spec.title}: its mapping here reads every layer as full attention. Use a "
            "checkpoint without a sliding window, or set sliding_window to null (or >= max_position_embeddings) "
            "in config.json if the model was trained without one."
        )


def refuse_qwen_sliding_window(fields: Fields) -> None:
    """Qwen2/Qwen3-MoE: ``sliding_window`` counts only with ``use_sliding_window`` (as transformers reads it)."""
    window = fields.raw.get("sliding_window") if fields.raw.get("use_sliding_window", False) else None
    refuse_sliding_window(fields, window)


def qwen_moe_layers(fields: Fields, num_layers: int) -> int | list[int]:
    """Qwen2/Qwen3-MoE's MoE layers (``moe_layer_freq``): every ``decoder_sparse_step``-th layer not in
    ``mlp_only_layers``; 1 when that is every layer."""
    dense = set(fields["mlp_only_layers"] or [])
    step = int(fields["decoder_sparse_step"])
    flags = [int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]
    return 1 if all(flags) else flags


def softmax_router_problems(
    config: MoETransformerConfig, family: str, *, always_renormalises: bool = False, dense_layers: bool = False,
) -> list[str]:
    """What of ``config``'s routing a softmax ``family`` cannot hold; ``always_renormalises``: the
    family has no ``norm_topk_prob``; ``dense_layers``: it allows dense layers between MoE ones."""
    moe, problems = config.moe, []
    if moe.score_func != "softmax":
        problems.append(f"score_func={moe.score_func!r}, {family} routes with softmax")
    if always_renormalises and moe.pre_softmax:
        problems.append(f"pre_softmax=True: {family} always renormalises the top-k probabilities")
    if moe.num_groups is not None or moe.expert_bias or moe.topk_scaling_factor not in (None, 1.0):
        problems.append(f"group-limited routing, expert bias and topk_scaling_factor do not exist in {family}")
    if moe.shared_expert_ffn_hidden_size:
        problems.append(f"{family} has no shared expert")
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    if dense and not dense_layers:
        problems.append(f"layers {dense} are dense, every {family} layer is MoE")
    return problems


def softmax_fields(config: MoETransformerConfig, *, head_dim: bool = True) -> dict[str, Any]:
    """The ``config.json`` keys every softmax family writes alike; ``head_dim``: the family stores one."""
    moe = config.moe
    fields = {
        "num_key_value_heads": config.kv_heads, "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coeffs.get("aux_loss", 0.0), "attention_bias": False,
    }
    if config.head_dim is not None and head_dim:
        fields["head_dim"] = config.head_dim
    return fields
