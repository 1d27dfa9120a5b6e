"""An independent, dense reference of `MoELayer`, written from the formulas (no library routing code).

docs/numerics.md §2 (scores, top-k, probs), §3 (group-limited top-k), §4 (capacity, dropping,
padding), §8/§9 (probs applied inside the expert, combine = plain sum) and §1 (shared
expert). Every expert is applied to *every* token and the result weighted by that
expert's column of the dense ``[T, E]`` probabilities, so no permutation, sorting or kernel code
of the library is involved. Padding (``pad_to_capacity``, ``router_padding_alignment``) only adds
rows of probability 0, which contribute nothing, so the reference ignores it.

Selections are checked for near-ties: if two candidates of a top-k (experts, groups, or tokens
competing for capacity) are closer than :data:`MIN_SELECTION_MARGIN`, the reference raises instead
of letting a rounding difference between it and the library flip the choice. A test that hits it
needs another seed.

Import as ``from layers.moe_reference import ...`` (``tests/`` is on ``sys.path``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_moe.layers.config import MoEConfig

__all__ = ["MIN_SELECTION_MARGIN", "dense_ffn", "reference_activation", "reference_moe", "reference_routing"]

# fp32 logits of the reference and of the layer may differ by a few ulps (different matmul
# kernels); a selection whose runner-up is this close could flip, so it is refused.
MIN_SELECTION_MARGIN = 1e-4

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def reference_activation(name: str, h: Tensor) -> Tensor:
    """The expert activations written out: gated ones split ``h`` as ``[gate ; up]``."""
    if name == "swiglu":
        gate, up = h[..., : h.shape[-1] // 2], h[..., h.shape[-1] // 2 :]
        return gate * torch.sigmoid(gate) * up
    if name == "clamped_swiglu":  # GPT-OSS's, with its alpha 1.702 and limit 7.0
        gate, up = h[..., : h.shape[-1] // 2], h[..., h.shape[-1] // 2 :]
        gate, up = torch.clamp(gate, max=7.0), torch.clamp(up, min=-7.0, max=7.0)
        return gate * torch.sigmoid(1.702 * gate) * (up + 1)
    if name == "gelu":
        return 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
    if name == "relu":
        return torch.clamp(h, min=0.0)
    if name == "squared_relu":
        return torch.clamp(h, min=0.0) ** 2
    raise AssertionError(f"reference has no activation {name!r}")


def _topk_indices(values: Tensor, k: int, what: str) -> Tensor:
    """Indices of the ``k`` largest entries of every row, refusing near-ties at the cut."""
    ordered = values.detach().sort(dim=-1, descending=True).values
    if k < values.shape[-1]:
        gap = ordered[..., k - 1] - ordered[..., k]  # +inf when the runner-up is masked to -inf
        if not bool((gap > MIN_SELECTION_MARGIN).all()):
            raise AssertionError(
                f"near-tie in the {what} selection (min gap {gap.min().item():.3g} <= "
                f"{MIN_SELECTION_MARGIN}); pick another seed"
            )
    return values.detach().topk(k, dim=-1).indices


def _select_experts(selection: Tensor, config: MoEConfig) -> Tensor:
    """Top-k experts per token, group-limited when configured (docs/numerics.md §3)."""
    top_k = config.top_k
    if config.num_groups is None:
        return _topk_indices(selection, top_k, "top-k")
    num_tokens, num_experts = selection.shape
    per_group = num_experts // config.num_groups
    grouped = selection.detach().reshape(num_tokens, config.num_groups, per_group)
    # A group's score: the sum of its top (K // group_top_k) scores.
    scored = top_k // config.group_top_k
    group_score = grouped.sort(dim=-1, descending=True).values[..., :scored].sum(dim=-1)
    kept_groups = _topk_indices(group_score, config.group_top_k, "group")
    group_keep = torch.zeros(num_tokens, config.num_groups, dtype=torch.bool)
    group_keep[torch.arange(num_tokens).unsqueeze(-1), kept_groups] = True
    expert_keep = group_keep.repeat_interleave(per_group, dim=1)
    masked = selection.detach().masked_fill(~expert_keep, float("-inf"))
    return _topk_indices(masked, top_k, "group-limited top-k")


def _capacity_mask(probs: Tensor, routing_map: Tensor, config: MoEConfig) -> Tensor:
    """Assignments that survive the per-expert capacity (docs/numerics.md §4; ``position``: earliest)."""
    num_tokens, num_experts = routing_map.shape
    capacity = math.ceil(num_tokens * config.top_k / num_experts * config.capacity_factor)
    if capacity >= num_tokens:
        return routing_map.clone()
    keep = torch.zeros_like(routing_map)
    for expert in range(num_experts):
        routed = routing_map[:, expert].nonzero().flatten()  # ascending token index
        if routed.numel() <= capacity:
            keep[routed, expert] = True
            continue
        if config.drop_policy == "position":
            keep[routed[:capacity], expert] = True
        else:
            column = probs[routed, expert].detach()
            winners = _topk_indices(column.unsqueeze(0), capacity, f"capacity (expert {expert})")[0]
            keep[routed[winners], expert] = True
    return keep


def reference_routing(
    logits: Tensor, config: MoEConfig, expert_bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Dense ``(probs [T, E], routing_map [T, E] bool)`` after top-k, scaling and capacity dropping."""
    num_tokens, num_experts = logits.shape
    top_k = config.top_k
    if config.score_func == "softmax":
        if config.pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            chosen = _select_experts(scores, config)
            top_probs = scores.gather(1, chosen)
        else:
            chosen = _select_experts(logits, config)
            top_probs = torch.softmax(logits.gather(1, chosen), dim=-1)
    else:
        if config.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            scores = torch.sqrt(torch.log1p(torch.exp(logits)))  # sqrt(softplus)
        selection = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
        chosen = _select_experts(selection, config)
        top_probs = scores.gather(1, chosen)  # the bias selects, it never weights
        if top_k > 1:
            top_probs = top_probs / (top_probs.sum(dim=-1, keepdim=True) + 1e-20)
    if config.topk_scaling_factor:
        top_probs = top_probs * config.topk_scaling_factor
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    routing_map[torch.arange(num_tokens).unsqueeze(-1), chosen] = True
    probs = torch.zeros_like(logits).scatter(1, chosen, top_probs)
    if config.capacity_factor is not None:
        routing_map = _capacity_mask(probs, routing_map, config)
        probs = probs * routing_map
    return probs, routing_map


def reference_moe(
    params: dict[str, Tensor],
    config: MoEConfig,
    hidden: Tensor,
    expert_bias: Tensor | None = None,
) -> Tensor:
    """``MoELayer`` output from its parameters (keys as in its state dict), computed densely.

    ``out[t] = sum_e p[t, e] * (fc2_e(act(fc1_e x_t)) + b2_e) + shared(x_t)``, where the shared
    expert is ``fc2(act(fc1 x)) * sigmoid(gate x)`` (gate optional). Computed in the dtype of
    ``hidden`` and ``params``; the logits and probs in the router dtype.
    """
    x = hidden.reshape(-1, hidden.shape[-1])
    router_dtype = _ROUTER_DTYPES.get(config.router_dtype, x.dtype)
    logits = x.to(router_dtype) @ params["router.weight"].to(router_dtype).T
    probs, _ = reference_routing(logits, config, expert_bias)

    fc1, fc2 = params["experts.fc1_weight"], params["experts.fc2_weight"]
    fc2_bias = params.get("experts.fc2_bias")
    out = torch.zeros_like(x)
    for expert in range(config.num_experts):
        y = reference_activation(config.activation, x @ fc1[expert].T) @ fc2[expert].T
        if fc2_bias is not None:
            y = y + fc2_bias[expert]
        out = out + probs[:, expert : expert + 1] * y
    if "shared_expert.fc1.weight" in params:
        shared = reference_activation(config.activation, x @ params["shared_expert.fc1.weight"].T)
        shared = shared @ params["shared_expert.fc2.weight"].T
        if "shared_expert.gate.weight" in params:
            shared = shared * torch.sigmoid(x @ params["shared_expert.gate.weight"].T)
        out = out + shared
    return out.to(x.dtype).reshape(hidden.shape)


def dense_ffn(x: Tensor, fc1: Tensor, fc2: Tensor, activation: str) -> Tensor:
    """A plain dense FFN ``fc2(act(fc1 x))`` through ``F.linear`` (the one-expert oracle)."""
    return F.linear(reference_activation(activation, F.linear(x, fc1)), fc2)
