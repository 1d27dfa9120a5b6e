"""Pure routing functions with Megatron Core semantics: scores, top-k, groups, capacity, bias update.

Reference: docs/numerics.md §2 (scores, top-k, probs), §3 (group-limited top-k), §4
(capacity, dropping, padding) and §7 (expert-bias sign rule). ``TopKRouter`` in
``router.py`` strings these together; they are importable from there too.

Shapes: ``T`` local tokens, ``E`` experts, ``K`` experts per token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "apply_input_jitter",
    "apply_token_dropping",
    "expert_capacity",
    "group_limited_topk",
    "padded_expert_rows",
    "random_logits_straight_through",
    "topk_routing",
    "update_expert_bias",
]

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
DROP_POLICIES = ("probs", "position")

# Denominator guard of Megatron's top-k renormalisation (moe_utils.py); kept for bit parity.
_NORMALISATION_EPS = 1e-20


def group_limited_topk(
    scores: Tensor, top_k: int, num_groups: int, group_top_k: int
) -> tuple[Tensor, Tensor]:
    """Top-k restricted to the best ``group_top_k`` of ``num_groups`` expert groups (docs/numerics.md §3).

    Megatron ``group_limited_topk``: experts form contiguous groups of ``E / num_groups``; a
    group's score is the sum of its top ``top_k // group_top_k`` scores (integer division, as
    upstream: DeepSeek-V3's K=8, 4 groups sums the top 2); the ``group_top_k`` best groups stay,
    every other expert is masked to ``-inf``, and the top-k of the masked scores is returned.

    Returns:
        ``(values [T, K], indices [T, K])`` of the masked scores.
    """
    num_tokens, num_experts = scores.shape
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by num_groups={num_groups}; "
            f"choose num_groups among the divisors of {num_experts}."
        )
    experts_per_group = num_experts // num_groups
    if not 1 <= group_top_k <= num_groups:
        raise ValueError(f"group_top_k={group_top_k} must be between 1 and num_groups={num_groups}.")
    if top_k > group_top_k * experts_per_group:
        raise ValueError(
            f"top_k={top_k} exceeds the {group_top_k * experts_per_group} experts in group_top_k="
            f"{group_top_k} groups of {experts_per_group}; raise group_top_k or lower top_k."
        )
    experts_scored_per_group = top_k // group_top_k
    if experts_scored_per_group < 1:
        # Upstream would sum zero scores per group and pick groups arbitrarily.
        raise ValueError(
            f"top_k={top_k} < group_top_k={group_top_k}: groups are scored by their top "
            f"top_k // group_top_k = 0 experts. Use group_top_k <= top_k."
        )
    grouped = scores.view(num_tokens, num_groups, experts_per_group)
    group_scores = grouped.topk(experts_scored_per_group, dim=-1).values.sum(dim=-1)
    group_indices = torch.topk(group_scores, k=group_top_k, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, group_indices, True)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, experts_per_group).reshape(num_tokens, num_experts)
    masked_scores = scores.masked_fill(~expert_mask, float("-inf"))
    return torch.topk(masked_scores, k=top_k, dim=-1)


def _validate_routing_args(
    logits: Tensor, top_k: int, score_func: str, pre_softmax: bool, expert_bias: Tensor | None
) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_tokens, num_experts], got shape {tuple(logits.shape)}.")
    if score_func not in SCORE_FUNCTIONS:
        raise ValueError(f"Unknown score_func {score_func!r}; choose one of {list(SCORE_FUNCTIONS)}.")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k={top_k} must be between 1 and num_experts={logits.shape[1]}.")
    if pre_softmax and score_func != "softmax":
        raise ValueError(f"pre_softmax=True only applies to score_func='softmax', not {score_func!r}.")
    if expert_bias is not None and score_func == "softmax":
        raise ValueError(
            "expert_bias needs score_func 'sigmoid' or 'sqrtsoftplus' (it is added to non-negative "
            "scores for selection); got score_func='softmax'."
        )


def topk_routing(
    logits: Tensor,
    top_k: int,
    score_func: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_top_k: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Route every token to its top-k experts, Megatron ``topk_routing_with_score_function``.

    As docs/numerics.md §2:

    * softmax, post (default): top-k of the logits, softmax over the K selected logits (fp32).
    * softmax, ``pre_softmax``: softmax over all experts, top-k, no renormalisation.
    * sigmoid / sqrtsoftplus: ``s = sigmoid(l)`` or ``sqrt(softplus(l))`` computed in fp32; the
      selection uses ``s + expert_bias`` when a bias is given (selection only), the values are
      the unbiased ``s``, renormalised ``s / (sum + 1e-20)`` when ``K > 1``.
    * With ``num_groups``/``group_top_k`` the top-k is :func:`group_limited_topk`, applied to the
      tensor used for selection (raw logits for softmax-post, softmax scores for pre, ``s + bias``).
    * ``probs *= scaling_factor`` when set, then probs are cast back to the logits dtype.

    Autocast is not managed here: ``TopKRouter`` calls this with autocast off, and so should any
    caller that wants the logits dtype throughout (CUDA autocast would run the sums of
    half-precision scores in fp32).

    Returns:
        ``(probs [T, E], routing_map [T, E] bool)``: dense; probs are zero off the selected experts.
    """
    _validate_routing_args(logits, top_k, score_func, pre_softmax, expert_bias)
    if (num_groups is None) != (group_top_k is None):
        raise ValueError(
            f"Group-limited routing needs both num_groups and group_top_k (got num_groups={num_groups}, "
            f"group_top_k={group_top_k}); set both or neither."
        )

    def select(selection_scores: Tensor) -> tuple[Tensor, Tensor]:
        if num_groups is not None:
            return group_limited_topk(selection_scores, top_k, num_groups, group_top_k)
        return torch.topk(selection_scores, k=top_k, dim=-1)

    if score_func == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, top_indices = select(scores)
        else:
            top_logits, top_indices = select(logits)
            probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    else:
        upcast = logits.float()
        raw = torch.sigmoid(upcast) if score_func == "sigmoid" else F.softplus(upcast).sqrt()
        scores = raw.type_as(logits)
        if expert_bias is not None:
            top_indices = select(scores + expert_bias)[1]
            top_scores = scores.gather(1, top_indices)
        else:
            top_scores, top_indices = select(scores)
        probs = (
            top_scores / (top_scores.sum(dim=-1, keepdim=True) + _NORMALISATION_EPS)
            if top_k > 1
            else top_scores
        )

    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.to(logits.dtype)
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_probs, routing_map


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Rows each expert may take, Megatron ``get_capacity``: ``ceil(num_tokens / E * factor)``.

    See docs/numerics.md §4. The router calls it with ``num_tokens = T * K`` for this rank's ``T``
    tokens of the micro-batch.
    """
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0; use None for dropless routing.")
    return math.ceil((num_tokens / num_experts) * capacity_factor)


def padded_expert_rows(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows every expert receives in drop-and-pad mode for ``num_tokens`` tokens of one rank.

    The capacity of :func:`expert_capacity`, but never more than the tokens there are: a
    capacity above ``T`` keeps every token (each expert then sees all ``T`` rows).
    """
    return min(expert_capacity(num_tokens * top_k, num_experts, capacity_factor), num_tokens)


def _rank_rows_by_probs(probs: Tensor, routing_map: Tensor) -> Tensor:
    """Per expert column, row indices ordered by probability (descending).

    Ties (equal probabilities, e.g. the zeros of unrouted rows) go to routed rows first, then to
    the earlier token: upstream's ``torch.topk`` leaves ties backend-dependent.
    """
    routed_first = torch.argsort(routing_map.to(torch.int8), dim=0, descending=True, stable=True)
    by_prob = torch.argsort(probs.detach().gather(0, routed_first), dim=0, descending=True, stable=True)
    return routed_first.gather(0, by_prob)


def apply_token_dropping(
    probs: Tensor,
    routing_map: Tensor,
    capacity: int,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> tuple[Tensor, Tensor]:
    """Enforce a per-expert capacity, Megatron ``apply_router_token_dropping`` (docs/numerics.md §4).

    Per expert column, the ``capacity`` kept rows are (when ``capacity <= T``; else nothing is
    dropped):

    * ``probs``: the highest probabilities (ties: routed rows, then earlier tokens);
    * ``position``: the earliest routed tokens, then (only as padding fillers) the earliest
      unrouted ones. Upstream takes ``torch.topk`` of the 0/1 column, whose choice among equal
      ones depends on the backend (on CPU it did not keep the earliest); we keep the earliest
      deterministically, so results match upstream's intent, not necessarily its bits.

    Without padding the map becomes ``routing_map & kept``; with ``pad_to_capacity`` it becomes
    ``kept`` itself, so every expert has exactly ``capacity`` rows, the filler rows carrying
    probability 0. Probs are multiplied by the final map.

    Returns:
        ``(probs [T, E], routing_map [T, E] bool)``.
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"Unknown drop_policy {drop_policy!r}; choose one of {list(DROP_POLICIES)}.")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}.")
    num_tokens = probs.shape[0]
    if capacity > num_tokens:
        kept = torch.ones_like(routing_map, dtype=torch.bool)
    else:
        if drop_policy == "probs":
            order = _rank_rows_by_probs(probs, routing_map)
        else:
            order = torch.argsort(routing_map.to(torch.int8), dim=0, descending=True, stable=True)
        kept = torch.zeros_like(routing_map, dtype=torch.bool).scatter(0, order[:capacity], True)
    final_map = kept if pad_to_capacity else routing_map & kept
    return probs * final_map, final_map


def apply_input_jitter(x: Tensor, eps: float, generator: torch.Generator | None = None) -> Tensor:
    """Multiply ``x`` by ``Uniform(1 - eps, 1 + eps)`` noise, Megatron ``apply_input_jitter`` (Switch).

    The noise is drawn in ``x``'s dtype from ``generator`` (default: torch's global RNG, whose
    state ``torch.utils.checkpoint`` restores, so a recomputed forward draws the same noise).
    """
    noise = torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps, generator=generator)
    return x * noise


class _RandomLogitsStraightThrough(torch.autograd.Function):
    """Forward: N(0, 1) logits of the same shape; backward: the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, logits: Tensor, generator: torch.Generator | None) -> Tensor:
        return torch.empty_like(logits).normal_(generator=generator)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, None]:
        return grad_output, None


def random_logits_straight_through(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Replace logits by N(0, 1) noise with a straight-through gradient, Megatron ``RandomSTE``.

    For benchmarks (``force_load_balancing``): routing is random and balanced in expectation,
    while the router weight still receives the gradient the random logits get. ``generator``
    defaults to torch's global RNG (restored by ``torch.utils.checkpoint`` on recompute).
    """
    return _RandomLogitsStraightThrough.apply(logits, generator)


def update_expert_bias(bias: Tensor, tokens_per_expert: Tensor, rate: float) -> Tensor:
    """Expert bias after one aux-loss-free update, Megatron ``get_updated_expert_bias``.

    docs/numerics.md §7: ``bias + rate * sign(mean(c) - c)`` with ``sign(0) = 0``, in fp32, where
    ``c`` are the counts of the global batch summed over TP x DP x CP. The sign is decided
    exactly: for integer counts as ``sign(sum(c) - E * c)`` in integers, for float counts in fp64
    (bf16 counts flip signs, upstream PR #7081). Returns a new fp32 tensor; the caller copies it
    into the buffer.
    """
    if tokens_per_expert.shape != bias.shape:
        raise ValueError(
            f"tokens_per_expert has shape {tuple(tokens_per_expert.shape)} but bias has {tuple(bias.shape)}."
        )
    counts = tokens_per_expert.double() if tokens_per_expert.is_floating_point() else tokens_per_expert.long()
    # sign(mean - c) == sign(sum - E * c) since E > 0; this form is exact for integer counts.
    direction = torch.sign(counts.sum() - counts * counts.numel())
    return bias.float() + rate * direction.to(device=bias.device, dtype=torch.float32)
