"""Load-balance statistics of one routed micro-batch, for monitoring (``TopKRouter.read_metric_stats``).

Pure single-device functions: they read a router's logits and routing maps and return small
device tensors, never reading anything back to the host. ``TopKRouter`` accumulates them in
non-persistent buffers once per micro-batch (docs/architecture.md §4); ``lightning_moe.metrics`` sums
them over ranks and micro-batches.

Definitions, for the ``T`` tokens of one micro-batch on this rank, ``K`` experts per token and
the valid tokens ``V`` (not marked as padding by ``padding_mask``):

* ``tokens = |V|``;
* ``routed = |V| * K``: (token, expert) assignments chosen by top-k routing (each token picks
  exactly ``K`` experts, with or without groups and expert bias);
* ``tokens_per_expert[e]``: assignments of valid tokens to expert ``e`` that survive the capacity
  limit: the top-k map AND the final map, so filler rows of ``pad_to_capacity`` and of the
  low-precision padding alignment are not load (:func:`kept_assignments`; the router's
  expert-bias counts ``local_tokens_per_expert`` count the same assignments);
* ``dropped = routed - sum(tokens_per_expert)``: assignments removed by the capacity limit
  (zero when dropless);
* ``entropy_sum = sum_{t in V} H(s_t)`` with ``H(s) = -sum_e s_e ln s_e`` (nats, ``0 ln 0 = 0``)
  of the routing scores normalised over all ``E`` experts, the distribution the load-balancing
  loss uses (docs/numerics.md §5.1): ``softmax(logits)`` for ``score_func="softmax"``, otherwise
  ``f(logits) / sum_e f(logits)`` with ``f = sigmoid`` or ``sqrt(softplus)``. Computed in fp32
  from the logits actually routed on (after jitter or forced balancing, without expert bias).
  Its mean over tokens lies in ``[0, ln E]``: ``ln E`` is a router that cannot tell experts
  apart, ``0`` one that is certain.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["METRIC_STAT_NAMES", "kept_assignments", "normalised_scores", "routing_metric_stats"]

METRIC_STAT_NAMES = ("tokens_per_expert", "dropped", "routed", "entropy_sum", "tokens")
"""Keys of :func:`routing_metric_stats` and of ``TopKRouter.read_metric_stats`` (buffers ``metric_<key>``)."""

# Guards the normalisation of sigmoid/sqrtsoftplus scores against an all-zero row (underflow).
_TINY = torch.finfo(torch.float32).tiny


def normalised_scores(logits: Tensor, score_func: str) -> Tensor:
    """The routing scores of ``logits`` ``[T, E]`` as an fp32 distribution over the experts."""
    logits = logits.float()
    if score_func == "softmax":
        return torch.softmax(logits, dim=-1)
    if score_func == "sigmoid":
        raw = torch.sigmoid(logits)
    elif score_func == "sqrtsoftplus":
        raw = torch.nn.functional.softplus(logits).sqrt()
    else:
        raise ValueError(f"Unknown score_func {score_func!r}; choose one of ['softmax', 'sigmoid', 'sqrtsoftplus'].")
    return raw / raw.sum(dim=-1, keepdim=True).clamp_min(_TINY)


def kept_assignments(selected_map: Tensor, final_map: Tensor, padding_mask: Tensor | None = None) -> Tensor:
    """``[T, E]`` bool: the real (token, expert) assignments, the load of ``tokens_per_expert``.

    Chosen by top-k (``selected_map``), kept by the capacity limit (``final_map``) and of a valid
    token (``padding_mask`` False). Filler rows of ``pad_to_capacity`` are in the final map only,
    so they are not load; ``TopKRouter`` counts the same mask for the expert-bias update.
    """
    kept = selected_map & final_map
    return kept if padding_mask is None else kept & (~padding_mask).unsqueeze(-1)


@torch.no_grad()
def routing_metric_stats(
    logits: Tensor,
    selected_map: Tensor,
    final_map: Tensor,
    top_k: int,
    score_func: str,
    padding_mask: Tensor | None = None,
) -> dict[str, Tensor]:
    """Statistics of one micro-batch (module docstring); device tensors keyed by `METRIC_STAT_NAMES`.

    Args:
        logits: ``[T, E]`` router logits.
        selected_map: ``[T, E]`` bool, the top-k choice before the capacity limit.
        final_map: ``[T, E]`` bool, the map after the capacity limit (and ``pad_to_capacity``).
        top_k: experts per token.
        score_func: ``softmax``, ``sigmoid`` or ``sqrtsoftplus``.
        padding_mask: ``[T]`` bool, True = padding (excluded from every statistic), or None.

    Returns:
        ``tokens_per_expert`` int64 ``[E]``; ``dropped``, ``routed``, ``tokens`` int64 scalars;
        ``entropy_sum`` fp32 scalar.
    """
    scores = normalised_scores(logits.detach(), score_func)
    entropy = -torch.special.xlogy(scores, scores).sum(dim=-1)
    if padding_mask is None:
        tokens = torch.full((), logits.shape[0], dtype=torch.int64, device=logits.device)
    else:
        valid = ~padding_mask
        entropy = entropy * valid
        tokens = valid.sum()
    tokens_per_expert = kept_assignments(selected_map, final_map, padding_mask).sum(dim=0)
    routed = tokens * top_k
    return {
        "tokens_per_expert": tokens_per_expert,
        "dropped": routed - tokens_per_expert.sum(),
        "routed": routed,
        "entropy_sum": entropy.sum(),
        "tokens": tokens,
    }
