"""Tests of the pure routing functions (`layers.routing`, re-exported by `layers.router`)."""

from __future__ import annotations

import math

import pytest
import torch
from layers.reference_values import REFERENCE_LOGITS, SOFTMAX_POST_PROBS

from lightning_moe.layers.router import (
    apply_input_jitter,
    apply_token_dropping,
    expert_capacity,
    group_limited_topk,
    random_logits_straight_through,
    topk_routing,
    update_expert_bias,
)

# Reference values of docs/numerics.md §15 are printed with 4 significant digits.
REFERENCE_ATOL = 1e-4
# fp32 routing probabilities against a float64 Python oracle: a few ulps.
FP32_PROB_ATOL = 1e-6



def _nonzeros(probs: torch.Tensor, token: int) -> dict[int, float]:
    return {int(e): probs[token, e].item() for e in torch.nonzero(probs[token]).flatten()}


def _assert_token_probs(probs: torch.Tensor, token: int, expected: dict[int, float]) -> None:
    actual = _nonzeros(probs, token)
    assert set(actual) == set(expected), f"token {token}: experts {sorted(actual)} != {sorted(expected)}"
    for expert, value in expected.items():
        assert actual[expert] == pytest.approx(value, abs=REFERENCE_ATOL), f"token {token}, expert {expert}"


def test_softmax_post_reference_probs():
    probs, routing_map = topk_routing(REFERENCE_LOGITS, 2)
    for token, expected in SOFTMAX_POST_PROBS.items():
        _assert_token_probs(probs, token, expected)
    assert torch.equal(routing_map, probs > 0)


def test_softmax_pre_reference_probs_are_not_renormalised():
    probs, _ = topk_routing(REFERENCE_LOGITS, 2, pre_softmax=True)
    _assert_token_probs(probs, 0, {0: 0.6095, 1: 0.2242})
    torch.testing.assert_close(probs.sum(-1) < 1, torch.ones(6, dtype=torch.bool))


def test_sigmoid_reference_probs():
    probs, _ = topk_routing(REFERENCE_LOGITS, 2, score_func="sigmoid")
    _assert_token_probs(probs, 0, {0: 0.5464, 1: 0.4536})
    # Token 5 ties experts 0, 1, 2 at sigmoid(0); upstream's CPU topk picked expert 2, as does ours.
    _assert_token_probs(probs, 5, {2: 0.3621, 3: 0.6379})


def test_sigmoid_with_expert_bias_and_scaling_reference():
    bias = torch.tensor([0.0, -1.0, 0.0, 0.5])
    probs, _ = topk_routing(REFERENCE_LOGITS, 2, score_func="sigmoid", scaling_factor=2.5, expert_bias=bias)
    _assert_token_probs(probs, 0, {0: 1.9152, 3: 0.5848})
    _assert_token_probs(probs, 1, {2: 1.3093, 3: 1.1907})


def test_sigmoid_top1_is_not_normalised():
    probs, _ = topk_routing(REFERENCE_LOGITS, 1, score_func="sigmoid")
    assert _nonzeros(probs, 0) == pytest.approx({0: 1 / (1 + math.exp(-2))}, abs=FP32_PROB_ATOL)


def test_sqrtsoftplus_matches_python_oracle():
    probs, _ = topk_routing(REFERENCE_LOGITS, 2, score_func="sqrtsoftplus")
    for token, row in enumerate(REFERENCE_LOGITS.tolist()):
        scores = [math.sqrt(math.log1p(math.exp(v))) for v in row]
        top_two = sorted(scores, reverse=True)[:2]
        actual = _nonzeros(probs, token)
        # Tokens 3 and 5 tie experts on equal logits: compare chosen scores, not expert ids.
        assert sorted(scores[e] for e in actual) == pytest.approx(sorted(top_two), abs=FP32_PROB_ATOL)
        expected = {e: scores[e] / sum(top_two) for e in actual}
        assert actual == pytest.approx(expected, abs=FP32_PROB_ATOL)


def test_probs_are_cast_back_to_logits_dtype():
    probs, _ = topk_routing(REFERENCE_LOGITS.bfloat16(), 2, score_func="sigmoid", scaling_factor=2.5)
    assert probs.dtype == torch.bfloat16
    probs64, _ = topk_routing(REFERENCE_LOGITS.double(), 2)
    assert probs64.dtype == torch.float64


# Groups of two experts: {0,1}, {2,3}, {4,5}, {6,7}. Expert 0 alone is the best expert, but the
# group sums of the top two favour groups 1 and 2.
GROUP_SCORES = torch.tensor([[0.9, 0.0, 0.5, 0.51, 0.6, 0.45, 0.1, 0.1]])


def test_group_limited_topk_scores_groups_by_top_k_over_group_top_k():
    # K=4, 2 groups -> each group scored by its top 2: sums 0.9, 1.01, 1.05, 0.2 -> groups 1, 2.
    values, indices = group_limited_topk(GROUP_SCORES, top_k=4, num_groups=4, group_top_k=2)
    assert sorted(indices.flatten().tolist()) == [2, 3, 4, 5]
    assert values.flatten().tolist() == pytest.approx([0.6, 0.51, 0.5, 0.45])


def test_group_limited_topk_uses_integer_division():
    # K=3, 2 groups -> top 3 // 2 = 1 expert per group (maxima 0.9, 0.51, 0.6, 0.1) -> groups 0, 2.
    _, indices = group_limited_topk(GROUP_SCORES, top_k=3, num_groups=4, group_top_k=2)
    assert indices.flatten().tolist() == [0, 4, 5]


def test_group_selection_uses_logits_for_softmax_post_and_scores_for_pre():
    # Group {0,1} has logits 3 and -10 (sum -7), group {2,3} has 1 and 1 (sum 2): on logits group 1
    # wins; on softmax scores (0.79 + 0.00 vs 0.11 + 0.11) group 0 wins.
    logits = torch.tensor([[3.0, -10.0, 1.0, 1.0]])
    _, post_map = topk_routing(logits, 2, num_groups=2, group_top_k=1)
    _, pre_map = topk_routing(logits, 2, pre_softmax=True, num_groups=2, group_top_k=1)
    assert post_map.nonzero()[:, 1].tolist() == [2, 3]
    assert pre_map.nonzero()[:, 1].tolist() == [0, 1]


def test_group_selection_uses_biased_scores_for_sigmoid():
    logits = torch.randn(16, 8)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.3, 0.3, -0.2, 0.1])
    probs, routing_map = topk_routing(logits, 4, "sigmoid", num_groups=4, group_top_k=2, expert_bias=bias)
    scores = torch.sigmoid(logits)
    _, expected_indices = group_limited_topk(scores + bias, 4, 4, 2)
    expected_map = torch.zeros_like(routing_map).scatter(1, expected_indices, True)
    assert torch.equal(routing_map, expected_map)
    selected = scores * expected_map
    torch.testing.assert_close(probs, selected / selected.sum(-1, keepdim=True), atol=FP32_PROB_ATOL, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_groups": 3, "group_top_k": 1, "top_k": 2}, "not divisible by num_groups=3"),
        ({"num_groups": 4, "group_top_k": 5, "top_k": 2}, "group_top_k=5 must be between 1"),
        ({"num_groups": 4, "group_top_k": 1, "top_k": 3}, "top_k=3 exceeds the 2 experts"),
        ({"num_groups": 4, "group_top_k": 3, "top_k": 2}, "top_k=2 < group_top_k=3"),
    ],
)
def test_group_limited_topk_rejects_bad_groups(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_limited_topk(GROUP_SCORES, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"score_func": "tanh"}, "Unknown score_func 'tanh'"),
        ({"top_k": 5}, "top_k=5 must be between 1 and num_experts=4"),
        ({"score_func": "sigmoid", "pre_softmax": True}, "pre_softmax=True only applies"),
        ({"expert_bias": torch.zeros(4)}, "expert_bias needs score_func"),
        ({"num_groups": 2}, "needs both num_groups and group_top_k"),
    ],
)
def test_topk_routing_rejects_bad_arguments(kwargs, match):
    kwargs = {"top_k": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        topk_routing(REFERENCE_LOGITS, **kwargs)


def test_topk_routing_rejects_non_2d_logits():
    with pytest.raises(ValueError, match=r"logits must be \[num_tokens, num_experts\]"):
        topk_routing(REFERENCE_LOGITS.view(2, 3, 4), 2)


def test_expert_capacity_reference_values():
    assert expert_capacity(12, 4, 1.0) == 3
    assert expert_capacity(12, 4, 0.5) == 2
    with pytest.raises(ValueError, match="capacity_factor=0 must be > 0"):
        expert_capacity(12, 4, 0)


def _kept_assignments(probs: torch.Tensor, routing_map: torch.Tensor) -> dict[int, dict[int, float]]:
    return {
        expert: {
            int(t): probs[t, expert].item()
            for t in torch.nonzero(routing_map[:, expert]).flatten()
            if probs[t, expert] > 0
        }
        for expert in range(routing_map.shape[1])
    }


# Reference 2.13 drop&pad (cf=1.0, cap=3, probs policy): the real (non-zero) rows kept per expert.
DROP_AND_PAD_KEPT = {
    0: {0: 0.7311, 4: 0.525},
    1: {0: 0.2689, 1: 0.525, 2: 0.8808},
    2: {1: 0.475, 3: 0.8808, 4: 0.475},
    3: {2: 0.1192, 5: 0.8808},
}


def test_drop_and_pad_reference():
    probs, routing_map = topk_routing(REFERENCE_LOGITS, 2)
    capacity = expert_capacity(6 * 2, 4, 1.0)
    dropped_probs, dropped_map = apply_token_dropping(
        probs, routing_map, capacity, "probs", pad_to_capacity=True
    )
    assert dropped_map.sum(dim=0).tolist() == [capacity] * 4
    kept = _kept_assignments(dropped_probs, dropped_map)
    for expert, expected in DROP_AND_PAD_KEPT.items():
        assert kept[expert] == pytest.approx(expected, abs=REFERENCE_ATOL)
    # Fillers carry probability 0 and are the earliest unrouted tokens (deterministic rule).
    fillers = dropped_map & ~routing_map
    assert torch.all(dropped_probs[fillers] == 0)
    assert fillers.nonzero().tolist() == [[0, 3], [1, 0]]  # (token, expert)


def test_drop_without_pad_keeps_highest_probs():
    probs, routing_map = topk_routing(REFERENCE_LOGITS, 2)
    dropped_probs, dropped_map = apply_token_dropping(probs, routing_map, 3, "probs")
    assert torch.equal(dropped_map, dropped_map & routing_map)
    kept = _kept_assignments(dropped_probs, dropped_map)
    for expert, expected in DROP_AND_PAD_KEPT.items():
        assert kept[expert] == pytest.approx(expected, abs=REFERENCE_ATOL)
    assert torch.equal(dropped_probs, probs * dropped_map)


def test_position_policy_keeps_earliest_tokens():
    probs, routing_map = topk_routing(REFERENCE_LOGITS, 2)
    _, dropped_map = apply_token_dropping(probs, routing_map, 2, "position")
    # Expert 1 is chosen by tokens 0, 1, 2, 3 and expert 2 by 1, 3, 4, 5: the first two stay.
    assert dropped_map[:, 1].nonzero().flatten().tolist() == [0, 1]
    assert dropped_map[:, 2].nonzero().flatten().tolist() == [1, 3]


def test_capacity_above_token_count_drops_nothing():
    probs, routing_map = topk_routing(REFERENCE_LOGITS, 2)
    dropped_probs, dropped_map = apply_token_dropping(probs, routing_map, 7, "probs")
    assert torch.equal(dropped_map, routing_map) and torch.equal(dropped_probs, probs)


def test_token_dropping_rejects_unknown_policy():
    probs, routing_map = topk_routing(REFERENCE_LOGITS, 2)
    with pytest.raises(ValueError, match="Unknown drop_policy 'random'"):
        apply_token_dropping(probs, routing_map, 3, "random")


def test_update_expert_bias_reference_example():
    bias = torch.zeros(4)
    for counts in (torch.tensor([10, 2, 4, 0]), torch.tensor([10.0, 2.0, 4.0, 0.0])):
        updated = update_expert_bias(bias, counts, 1e-3)
        assert updated.dtype == torch.float32
        torch.testing.assert_close(updated, torch.tensor([-1e-3, 1e-3, 0.0, 1e-3]), atol=0, rtol=0)


def test_update_expert_bias_is_exact_for_large_counts():
    # fp32 cannot tell 2**25 from 2**25 + 1; the sign decision must.
    counts = torch.tensor([2**25 + 1, 2**25 - 1, 2**25, 2**25], dtype=torch.int64)
    updated = update_expert_bias(torch.zeros(4, dtype=torch.bfloat16), counts, 1e-3)
    torch.testing.assert_close(updated, torch.tensor([-1e-3, 1e-3, 0.0, 0.0]), atol=0, rtol=0)
    with pytest.raises(ValueError, match="tokens_per_expert has shape"):
        update_expert_bias(torch.zeros(4), torch.zeros(3), 1e-3)


def test_input_jitter_stays_within_bounds():
    x = torch.ones(1000, 4)
    jittered = apply_input_jitter(x, 0.1, generator=torch.Generator().manual_seed(1))
    assert jittered.min() >= 0.9 and jittered.max() <= 1.1 and jittered.std() > 0


def test_random_logits_straight_through():
    logits = torch.zeros(5, 4, requires_grad=True)
    random = random_logits_straight_through(logits, torch.Generator().manual_seed(3))
    torch.testing.assert_close(random, torch.empty(5, 4).normal_(generator=torch.Generator().manual_seed(3)))
    upstream_grad = torch.randn(5, 4)
    random.backward(upstream_grad)
    torch.testing.assert_close(logits.grad, upstream_grad, atol=0, rtol=0)
