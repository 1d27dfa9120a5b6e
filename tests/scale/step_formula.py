"""Upper bounds of a training step's memory on one rank, from the config (oracle of test_fake_step.py).

The bounds count, in the way Megatron's activation-memory analysis does (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", 2022), the tensors a transformer
block keeps for backward for this rank's tokens, with flash attention (nothing of size ``S x S``)
and without recompute:

* ``T`` = local tokens: ``batch x seq / TP`` (sequence parallelism: norms, residual and the MoE
  layer see this rank's slice); ``Tg`` = ``T x TP`` tokens where attention and dense MLPs gather
  the sequence; ``R`` = ``T x top_k`` routed rows (forced-balanced routing: every rank receives
  as many rows as it sends);
* per block: the two norms' inputs and outputs and the residual (``6 T H``); every projection's
  input and output (``Tg x (in + out)``, widths local to the TP rank) and the core attention's
  q, k, v and output; for a dense MLP gate/up and down (``Tg (2H + 3 F/TP)``); for an MoE layer
  the router's logits, scores, probs and map (``4 T E``), the rows sent, received and returned
  (``3 R H``), the experts as a dense MLP over ``R`` rows of width ``F/ETP``
  (``R (2H + 3 F/ETP)``), the combined output (``T H``) and the shared expert (``T (2H + 3 Fs)``).

Every element is counted at 4 bytes (fp32). Under bf16-mixed most of these tensors are bf16: the
factor of two left over is the allowance for what the list does not name (autocast's bf16 copy
of a projection's input made once per projection, rotary outputs, fp32 norm statistics). The
bf16 copies of the weights that bf16-mixed computes with (2 bytes per local parameter) are added
separately. A rank holding more than this for its blocks holds something that does not scale
with its tokens: a world-sized buffer, another rank's rows, a gathered weight.
"""

from __future__ import annotations

from lightning_moe.models import MoETransformerConfig
from lightning_moe.parallel import ParallelDims

__all__ = [
    "FP32",
    "block_activation_bytes",
    "block_parameters",
    "head_activation_bytes",
    "head_parameters",
    "largest_local_tensor",
    "local_experts_parameters",
    "logits_bytes",
    "tp_replicated_parameters",
]

FP32 = 4
"""Bytes per element of every counted activation, gradient, master weight and Adam moment."""
BF16 = 2


def _attention_widths(config: MoETransformerConfig, tp: int) -> tuple[list[tuple[int, int]], int]:
    """(in, out) of every attention projection local to a TP rank, and the core attention's
    q + k + v + output width."""
    hidden, heads = config.hidden_size, config.num_attention_heads // tp
    if config.attention == "mla":
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        projections = [(hidden, config.kv_lora_rank + config.qk_rope_head_dim),
                       (config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim)),
                       (heads * config.v_head_dim, hidden)]
        if config.q_lora_rank:
            projections += [(hidden, config.q_lora_rank), (config.q_lora_rank, heads * qk)]
        else:
            projections.append((hidden, heads * qk))
        return projections, heads * (qk + qk + config.v_head_dim + config.v_head_dim)
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    kv_heads = (config.num_kv_heads or config.num_attention_heads) // tp
    q, kv = heads * head_dim, kv_heads * head_dim
    projections = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden)]
    return projections, q + kv + kv + q


def block_activation_bytes(config: MoETransformerConfig, dims: ParallelDims, index: int, local_tokens: int) -> int:
    """Bytes block ``index`` keeps for backward for ``local_tokens`` (module docstring)."""
    hidden, tp = config.hidden_size, dims.tp
    tokens, gathered = local_tokens, local_tokens * tp
    elements = 6 * tokens * hidden
    projections, core = _attention_widths(config, tp)
    elements += gathered * (sum(i + o for i, o in projections) + core)
    if config.is_moe_layer(index):
        moe = config.moe
        rows, width = tokens * moe.top_k, moe.ffn_hidden_size // dims.etp
        shared = moe.shared_expert_ffn_hidden_size or 0
        elements += 4 * tokens * moe.num_experts + 3 * rows * hidden + rows * (2 * hidden + 3 * width)
        elements += tokens * hidden + tokens * (2 * hidden + 3 * shared)
    else:
        elements += gathered * (2 * hidden + 3 * config.ffn_hidden_size // tp)
    return FP32 * elements


def block_parameters(config: MoETransformerConfig, dims: ParallelDims, index: int) -> int:
    """Parameter elements this rank holds of block ``index`` (NO_SHARD)."""
    from scale.formula import local_parameters

    return local_parameters(config, dims, layers=[index], first=False, last=False)


def local_experts_parameters(config: MoETransformerConfig, dims: ParallelDims) -> int:
    """Routed-expert parameter elements this rank holds (NO_SHARD)."""
    moe = config.moe
    per_layer = moe.num_experts // dims.ep * 3 * config.hidden_size * (moe.ffn_hidden_size // dims.etp)
    return per_layer * sum(config.is_moe_layer(i) for i in range(config.num_layers))


def head_activation_bytes(config: MoETransformerConfig, dims: ParallelDims, local_tokens: int) -> int:
    """Bytes the final norm, the head and the loss keep for backward with vocabulary-parallel logits
    (``parallel/vocab_parallel_loss.py``, Megatron's cross-entropy): the norm's input and output, the
    head's input gathered over the sequence (``Tg x H``), and one fp32 ``[Tg, V/TP]`` buffer, the
    softmax that the loss writes over its shifted fp32 copy of the logits and keeps for backward
    (which turns it into the gradient in place). The head's own logits are not kept (a linear
    layer keeps its input), so the ``[Tg, V/TP]`` term appears once; a loss over gathered logits
    would keep ``Tg x V``, TP times more. At 4 bytes as everything here (the softmax really is fp32).
    The bf16 copy of the head's weight that autocast computes with is `head_parameters`."""
    hidden, gathered = config.hidden_size, local_tokens * dims.tp
    return FP32 * (2 * local_tokens * hidden + gathered * hidden + gathered * (config.vocab_size // dims.tp))


def logits_bytes(config: MoETransformerConfig, dims: ParallelDims, local_tokens: int) -> int:
    """One ``[Tg, V/TP]`` tensor of this rank's vocabulary slice, at 4 bytes: what the loss holds
    for a moment beside its kept softmax (the head's bf16 logits in forward, their bf16 gradient
    in backward)."""
    return FP32 * local_tokens * dims.tp * (config.vocab_size // dims.tp)


def head_parameters(config: MoETransformerConfig, dims: ParallelDims) -> int:
    """Parameter elements this rank holds of the output head: its ``V/TP x H`` vocabulary slice."""
    return config.vocab_size // dims.tp * config.hidden_size


def largest_local_tensor(config: MoETransformerConfig, dims: ParallelDims) -> int:
    """Elements of the largest parameter this rank holds: the vocabulary shard of the embedding or
    head, a layer's stacked expert fc1, or a dense gate/up projection."""
    hidden, tp = config.hidden_size, dims.tp
    candidates = [config.vocab_size // tp * hidden]
    if config.moe is not None:
        moe = config.moe
        candidates.append(moe.num_experts // dims.ep * 2 * (moe.ffn_hidden_size // dims.etp) * hidden)
    if config.ffn_hidden_size:
        candidates.append(config.ffn_hidden_size // tp * hidden)
    return max(candidates)


def tp_replicated_parameters(config: MoETransformerConfig) -> int:
    """Parameter elements every TP rank holds whole (scale/formula.py's list): the norms, per-head
    q/k norms, MLA's down projections and latent norms, the routers and the shared experts."""
    hidden = config.hidden_size
    elements = hidden  # the final norm
    for index in range(config.num_layers):
        elements += 2 * hidden
        if config.attention == "mla":
            elements += (config.kv_lora_rank + config.qk_rope_head_dim) * hidden + config.kv_lora_rank
            if config.q_lora_rank:
                elements += config.q_lora_rank * hidden + config.q_lora_rank
        elif config.qk_norm:
            elements += 2 * (config.head_dim or hidden // config.num_attention_heads)
        if config.is_moe_layer(index):
            moe = config.moe
            elements += moe.num_experts * hidden + 3 * hidden * (moe.shared_expert_ffn_hidden_size or 0)
    return elements
