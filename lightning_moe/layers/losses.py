"""Router auxiliary losses with Megatron Core semantics, and the autograd scaler that applies them.

Reference: docs/numerics.md §5 (load-balancing losses) and §6 (z-loss).

The losses are pure functions of *local* tensors plus counts that the caller has already summed
over the right group of ranks (this package never calls collectives): the router sums the counts
with the closures of its ``RouterReduction`` and passes the results and the group sizes here.

The losses never enter the user's objective. :func:`attach_loss` hooks each one onto a tensor of
the forward graph (the routing probabilities or the logits) so that backward gives the loss the
gradient ``scale``, exactly like Megatron's ``MoEAuxLossAutoScaler`` but without class-level state.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

__all__ = [
    "UNMANAGED_SCALE_WARNING",
    "AuxLossScaler",
    "attach_loss",
    "aux_loss",
    "aux_loss_scores",
    "global_aux_loss",
    "seq_aux_loss",
    "switch_load_balancing_loss",
    "tokens_per_sequence_and_expert",
    "z_loss",
]

# Denominator guard of Megatron's sigmoid-score normalisation (moe_utils.py); kept for bit parity.
_NORMALISATION_EPS = 1e-20


def switch_load_balancing_loss(
    probs: Tensor,
    tokens_per_expert: Tensor,
    total_num_tokens: int | float | Tensor,
    top_k: int,
    num_experts: int,
    coeff: float,
) -> Tensor:
    """Switch/GShard load-balancing loss, Megatron ``switch_load_balancing_loss_func``.

    ``loss = coeff * E / (K * N**2) * sum_i (sum_{t local} probs[t, i]) * c_i``, i.e.
    ``coeff * E * sum_i f_i * P_i`` with ``f_i = c_i / (N K)`` from the counts ``c`` of the whole
    group and ``P_i`` from this rank's rows only, so the values of the ranks of a group sum to the
    loss of the group's tokens (docs/numerics.md §5.2).

    Args:
        probs: ``[T_local, E']`` scores of the local tokens (rows of padded tokens already zero).
        tokens_per_expert: ``[E']`` assignment counts summed over the group (int or float).
        total_num_tokens: ``N``, the number of (valid) tokens of the whole group.
        top_k: experts per token ``K``.
        num_experts: ``E`` of the formula (the seq variant passes ``E``, not ``E' = B*E``).
        coeff: loss coefficient ``alpha``.
    """
    aggregated_probs_per_expert = probs.sum(dim=0)
    scale = num_experts * coeff / (top_k * total_num_tokens * total_num_tokens)
    return torch.sum(aggregated_probs_per_expert * tokens_per_expert) * scale


def aux_loss_scores(
    logits: Tensor, top_k: int, score_func: str, padding_mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Scores and routing map used by the load-balancing losses (docs/numerics.md §5.1).

    Recomputed from the logits, independent of the routing decision: ``softmax`` over all experts
    (in fp32), or ``sigmoid`` / ``sqrtsoftplus`` scores normalised to sum to 1 over the experts;
    the map is the plain top-k of those scores (no expert bias, groups or capacity). Rows of padded
    tokens (``padding_mask`` True) are zeroed in both.

    Returns:
        ``(scores [T, E], routing_map [T, E] bool)``.
    """
    if score_func == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif score_func in ("sigmoid", "sqrtsoftplus"):
        raw = (
            torch.sigmoid(logits) if score_func == "sigmoid" else torch.nn.functional.softplus(logits).sqrt()
        )
        scores = raw / (raw.sum(dim=-1, keepdim=True) + _NORMALISATION_EPS)
    else:
        raise ValueError(
            f"Unknown score_func {score_func!r}; choose one of ['softmax', 'sigmoid', 'sqrtsoftplus']."
        )
    top_indices = torch.topk(scores, k=top_k, dim=-1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top_indices, True)
    if padding_mask is not None:
        valid = (~padding_mask).unsqueeze(-1)
        scores = scores * valid
        routing_map = routing_map & valid
    return scores, routing_map


def _group_num_tokens(
    num_local_rows: int, group_size: int, counts: Tensor, tokens_per_row: int, with_padding_mask: bool
) -> int | Tensor:
    """``N`` of docs/numerics.md §5.3: local rows times the group size, or valid tokens from the counts.

    With a padding mask every valid token contributes ``tokens_per_row`` assignments to the counts,
    so ``sum(counts) / tokens_per_row`` is the group's valid-token count. Both are clamped at 1 so
    a group made only of padding, or a rank (micro-batch) with no tokens, gives a zero loss (its
    scores sum to zero) instead of Megatron's 0/0 = NaN or a ``ZeroDivisionError``.
    """
    if not with_padding_mask:
        return max(num_local_rows * group_size, 1)
    return torch.clamp(counts.sum() / tokens_per_row, min=1.0)


def aux_loss(
    scores: Tensor,
    tokens_per_expert: Tensor,
    top_k: int,
    coeff: float,
    group_size: int = 1,
    with_padding_mask: bool = False,
) -> Tensor:
    """Micro-batch load-balancing loss, Megatron ``aux_loss`` (docs/numerics.md §5.3, first row).

    Args:
        scores: ``[T_local, E]`` local aux-loss scores (:func:`aux_loss_scores`).
        tokens_per_expert: ``[E]`` aux-map counts summed over the TP x CP group.
        top_k: experts per token.
        coeff: coefficient ``alpha``.
        group_size: size of the TP x CP group; ``N = T_local * group_size`` without padding.
        with_padding_mask: whether padded rows were zeroed; then ``N = sum(counts) / K``.

    Returns:
        This rank's share of the loss of its TP x CP group's tokens (shares sum to the loss).
    """
    total = _group_num_tokens(scores.shape[0], group_size, tokens_per_expert, top_k, with_padding_mask)
    return switch_load_balancing_loss(scores, tokens_per_expert, total, top_k, scores.shape[1], coeff)


def tokens_per_sequence_and_expert(routing_map: Tensor, num_sequences: int) -> Tensor:
    """Local ``[B, E]`` assignment counts of a sequence-major ``[B * S_local, E]`` routing map."""
    num_tokens, num_experts = routing_map.shape
    return routing_map.view(num_sequences, num_tokens // num_sequences, num_experts).sum(dim=1)


def seq_aux_loss(
    scores: Tensor,
    tokens_per_sequence_and_expert: Tensor,
    num_sequences: int,
    top_k: int,
    coeff: float,
    group_size: int = 1,
    with_padding_mask: bool = False,
) -> Tensor:
    """Sequence-level load-balancing loss, Megatron ``seq_aux_loss`` (docs/numerics.md §5.3, second row).

    The mean over the ``B`` sequences of each sequence's Switch loss. Megatron reshapes its
    s-major ``[S_local * B, E]`` rows to ``[S_local, B * E]`` so that every (sequence, expert) pair
    is its own column; our rows are b-major (token ``b * S_local + s``), and the per-sequence
    statistics are the same either way.

    Args:
        scores: ``[B * S_local, E]`` local aux-loss scores, sequence-major.
        tokens_per_sequence_and_expert: ``[B, E]`` counts
            (:func:`tokens_per_sequence_and_expert`) summed over the TP x CP group.
        num_sequences: ``B``.
        top_k: experts per token.
        coeff: coefficient ``alpha``.
        group_size: size of the TP x CP group; ``N = S_local * group_size`` (the full sequence
            length) without padding.
        with_padding_mask: whether padded rows were zeroed; then, as upstream,
            ``N = sum(counts) / (K * B)``, the mean valid length of the sequences.
    """
    num_tokens, num_experts = scores.shape
    local_seq_len = num_tokens // num_sequences
    # [B, S_local, E] -> [S_local, B * E]: column b * E + e is expert e of sequence b.
    per_pair_scores = scores.view(num_sequences, local_seq_len, num_experts).transpose(0, 1)
    per_pair_scores = per_pair_scores.reshape(local_seq_len, num_sequences * num_experts)
    counts = tokens_per_sequence_and_expert.reshape(num_sequences * num_experts)
    total = _group_num_tokens(local_seq_len, group_size, counts, top_k * num_sequences, with_padding_mask)
    loss_sum = switch_load_balancing_loss(per_pair_scores, counts, total, top_k, num_experts, coeff)
    return loss_sum / num_sequences


def global_aux_loss(
    scores: Tensor,
    mean_tokens_per_expert: Tensor,
    step_tokens_per_expert: Tensor,
    top_k: int,
    coeff: float,
    group_size: int = 1,
    with_padding_mask: bool = False,
) -> Tensor:
    """Global-batch load-balancing loss, Megatron ``global_aux_loss`` (docs/numerics.md §5.3, third row).

    Args:
        scores: ``[T_local, E]`` local aux-loss scores.
        mean_tokens_per_expert: ``[E]`` running mean, over the micro-batches seen so far in this
            global batch, of the counts summed over TP x DP x CP (the router keeps the sums).
        step_tokens_per_expert: ``[E]`` this micro-batch's counts summed over TP x DP x CP; only
            used for ``N`` with a padding mask (``N = sum / K``), as upstream.
        top_k: experts per token.
        coeff: coefficient ``alpha``.
        group_size: size of the TP x DP x CP group; ``N = T_local * group_size`` without padding.
        with_padding_mask: whether padded rows were zeroed.

    Returns:
        This rank's share of the loss over the whole TP x DP x CP batch (shares sum to the loss);
        this is also the value that is logged (divided by ``coeff``).

    Gradient scale under data parallelism (docs/numerics.md §5.4, Megatron issue #3672, a deliberate
    difference from upstream): each rank's value is a share of a loss whose ``N`` counts the
    tokens of all DP ranks, so its gradient is about ``1/DP`` of an ``aux_loss`` gradient; when
    the strategy then averages dense gradients over DP, Megatron's global-aux gradient ends up
    ``DP`` times too small at equal coefficient. We attach ``DP * value`` instead, with
    ``DP = tp_dp_cp_size / tp_cp_size``: after the DP average the gradient equals that of the
    global-batch loss itself, on the same footing as ``aux_loss`` at the same coefficient. The
    router does this multiplication (``TopKRouter``); the returned value stays the share.
    """
    total = _group_num_tokens(scores.shape[0], group_size, step_tokens_per_expert, top_k, with_padding_mask)
    return switch_load_balancing_loss(scores, mean_tokens_per_expert, total, top_k, scores.shape[1], coeff)


def z_loss(logits: Tensor, coeff: float, padding_mask: Tensor | None = None, tp_cp_size: int = 1) -> Tensor:
    """Router z-loss of ST-MoE, Megatron ``z_loss_func`` / ``apply_z_loss`` (docs/numerics.md §6).

    ``coeff / tp_cp_size * mean_t logsumexp(logits[t])**2`` over the local valid tokens (the mean
    over valid tokens uses ``max(count, 1)``). The ``1 / tp_cp_size`` makes the TP x CP ranks,
    whose router weight gradients are summed, contribute one mean together.
    """
    squared_logsumexp = torch.square(torch.logsumexp(logits, dim=-1))
    if padding_mask is None:
        mean = squared_logsumexp.sum() / max(logits.shape[0], 1)
    else:
        valid = ~padding_mask
        mean = (squared_logsumexp * valid).sum() / torch.clamp(valid.sum(), min=1)
    return mean * (coeff / tp_cp_size)


class AuxLossScaler(torch.autograd.Function):
    """Identity on a tensor that makes backward give an attached loss the gradient ``scale``.

    Megatron ``MoEAuxLossAutoScaler`` (docs/numerics.md §5.4), with the scale passed in rather than held in
    class-level state. Use through :func:`attach_loss`.
    """

    @staticmethod
    def forward(ctx, tensor: Tensor, loss: Tensor, scale: float | Tensor) -> Tensor:
        """Return ``tensor`` unchanged and keep ``loss`` (and ``scale``) for backward."""
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return tensor

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, Tensor, None]:
        """Pass ``grad_output`` through; the loss receives ``scale`` as its gradient."""
        (loss,) = ctx.saved_tensors
        scale = ctx.scale
        if isinstance(scale, Tensor):
            scale = scale.to(device=loss.device, dtype=loss.dtype)
        return grad_output, torch.ones_like(loss) * scale, None


UNMANAGED_SCALE_WARNING = (
    "An MoE router attaches its auxiliary/z losses with gradient scale 1.0 because nothing sets the "
    "scale. Their gradients must scale like the main loss's: by the GradScaler's scale under "
    "precision='16-mixed' and by 1/accumulate_grad_batches. Under Lightning, use MoEStrategy or add "
    "the callback lightning_moe.callbacks.MoELossScaling(); without Lightning, call "
    "lightning_moe.layers.set_aux_loss_scale(model, scale) with what your loop multiplies the loss by "
    "(1.0 when that is nothing)."
)
"""Warned (once per process under Python's default filter) when a loss is attached with ``scale=None``."""


def attach_loss(tensor: Tensor, loss: Tensor, scale: float | Tensor | None = 1.0) -> Tensor:
    """Return ``tensor`` unchanged in value, with ``scale * dloss/dtheta`` added to the gradients.

    The gradient of ``tensor`` itself passes through unchanged. ``scale`` is a float or a 0-dim
    tensor, read when backward runs (:class:`~lightning_moe.layers.loss_scale.LossGradScale`
    rewrites one in place before every backward). ``None`` means nobody manages the scale: 1.0
    is used and :data:`UNMANAGED_SCALE_WARNING` is issued.
    """
    if scale is None:
        # One fixed location (stacklevel=1): Python's default filter then shows it once per process.
        warnings.warn(UNMANAGED_SCALE_WARNING, UserWarning, stacklevel=1)
        scale = 1.0
    return AuxLossScaler.apply(tensor, loss, scale)
