"""Per-rank memory of a parallel layout, computed from the model config alone (the oracle of the
scale tests; a layout planner can reuse `training_state_bytes`).

`local_parameters` counts, from the config fields, what one rank of a folded TP/EP/ETP layout
holds after ``parallelize``:

* embedding and untied head: vocabulary-sharded over TP;
* attention: query/key/value and output projections sharded over TP (for multi-latent attention
  the up-projections and the output projection; the low-rank down-projections and latent norms
  are replicated, as in Megatron); per-head q/k norms replicated;
* dense MLP layers: gate, up and down sharded over TP;
* MoE layers: router and shared expert replicated over TP; the routed experts split over EP
  (``num_experts / ep`` each) and every expert's SwiGLU width over ETP;
* all RMSNorm weights replicated.

Under FSDP2 (``SHARD_GRAD_OP``/``FULL_SHARD``) each of those is further split over DP (dense side,
``dp x cp`` ranks) or EDP (experts). The layouts tested divide every sharded dimension evenly, so
the split is exact; `local_parameters` checks that and raises otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning_moe.models import MoETransformerConfig
from lightning_moe.parallel import ParallelDims

__all__ = ["global_parameters", "local_parameters", "training_state_bytes"]


def _div(value: int, by: int, what: str) -> int:
    if value % by:
        raise ValueError(f"{what}={value} is not divisible by {by}: the formula assumes even shards")
    return value // by


def local_parameters(
    config: MoETransformerConfig,
    dims: ParallelDims,
    fsdp: bool = False,
    layers: Iterable[int] | None = None,
    first: bool = True,
    last: bool = True,
) -> int:
    """Parameter elements one rank holds (module docstring); ``fsdp``: FSDP2 sharding on top.

    Under pipeline parallelism pass this rank's stages: the block indices it holds (``layers``),
    whether it holds the embedding (``first``) and the final norm and head (``last``)."""
    tp, hidden, vocab = dims.tp, config.hidden_size, config.vocab_size
    dense_shard = dims.dp * dims.cp if fsdp else 1  # FSDP2's dense mesh is dp x cp
    expert_shard = dims.edp if fsdp else 1
    vocab_part = _div(vocab, tp, "vocab_size") * hidden
    tied = config.tie_embeddings
    dense = (vocab_part if first or tied else 0) + ((0 if tied else vocab_part) + hidden if last else 0)
    experts = 0
    for index in range(config.num_layers) if layers is None else layers:
        dense += 2 * hidden + _attention(config, tp)
        if config.is_moe_layer(index):
            moe = config.moe
            dense += moe.num_experts * hidden  # router
            shared = getattr(moe, "shared_expert_ffn_hidden_size", None) or 0
            dense += 3 * hidden * shared
            local_experts = _div(moe.num_experts, dims.ep, "num_experts")
            experts += local_experts * 3 * hidden * _div(moe.ffn_hidden_size, dims.etp, "moe.ffn_hidden_size")
        else:
            dense += 3 * hidden * _div(config.ffn_hidden_size, tp, "ffn_hidden_size")
    return _div(dense, dense_shard, "dense elements") + _div(experts, expert_shard, "expert elements")


def _attention(config: MoETransformerConfig, tp: int) -> int:
    hidden, heads = config.hidden_size, _div(config.num_attention_heads, tp, "num_attention_heads")
    if config.attention == "mla":
        q_rank, kv_rank = config.q_lora_rank, config.kv_lora_rank
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        q = q_rank * hidden + q_rank + heads * qk * q_rank  # down + latent norm replicated, up sharded
        kv = (kv_rank + config.qk_rope_head_dim) * hidden + kv_rank
        kv += heads * (config.qk_nope_head_dim + config.v_head_dim) * kv_rank
        return q + kv + hidden * heads * config.v_head_dim
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    kv_heads = _div(config.num_kv_heads or config.num_attention_heads, tp, "num_kv_heads")
    if config.qk_norm not in (False, True, "head"):
        raise NotImplementedError(f"qk_norm={config.qk_norm!r}: only per-head q/k norms are counted here")
    norms = 2 * head_dim if config.qk_norm else 0
    return 2 * heads * head_dim * hidden + 2 * kv_heads * head_dim * hidden + norms


def global_parameters(config: MoETransformerConfig) -> int:
    """The whole model's parameter count: one rank's share at world 1."""
    return local_parameters(config, ParallelDims(world_size=1))


def training_state_bytes(
    local_params: int, param_bytes: int = 4, grad_bytes: int = 4, optimizer_states: int = 2, state_bytes: int = 4,
    grad_elements: int | None = None,
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer states one rank holds for ``local_params`` elements.

    Defaults: fp32 parameters and gradients, Adam's two fp32 moments (``exp_avg``, ``exp_avg_sq``).
    Gradients have the parameters' local shapes (FSDP2 reduce-scatters every micro-batch into the
    shard; replicated data parallelism reduces in place), so they count like the parameters, unless
    ``grad_elements`` says otherwise: with ``defer_gradient_reduction=True`` and several
    micro-batches (gradient accumulation, pipeline schedules) a sharded rank holds, between them,
    the unsharded gradients, ``local_parameters(config, dims)`` (without ``fsdp``), DP (EDP for
    experts) times the shard.
    """
    params = local_params * param_bytes
    grads = (local_params if grad_elements is None else grad_elements) * grad_bytes
    optimizer = local_params * optimizer_states * state_bytes
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}
