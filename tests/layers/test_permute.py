"""Tests of `lightning_moe.layers.permute` against upstream reference values and dense oracles."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layers.reference_values import SOFTMAX_POST_PROBS

from lightning_moe.layers.permute import pad_routing_map, permute, tokens_per_expert, unpermute

# fp32 sums of at most E=16 products of O(1) numbers, in a different summation order than the
# dense einsum oracle: a few ulps of the result, far below 1e-5.
FP32_OUTPUT_ATOL = 1e-5
# Sums of up to 16 rows of magnitude ~4 reach ~70, where one fp32 ulp is already ~8e-6: add torch's
# default fp32 relative tolerance so large sums are judged in ulps, not absolutely.
FP32_OUTPUT_RTOL = 1.3e-6
# Gradients go through one more reduction (over H or over rows) than the outputs.
FP32_GRAD_ATOL = 1e-4
# A scalar loss summing up to 64*16*8 products: its rounding error grows with its magnitude, so it
# is compared relatively (fp32 eps is 1.2e-7; 1e-5 leaves room for ~100 ulps).
FP32_SCALAR_SUM_RTOL = 1e-5
# The permuted probabilities and the per-row copies are gathers: bit-exact.
EXACT = 0.0

HYPOTHESIS_SETTINGS = settings(max_examples=50, deadline=None)

# docs/numerics.md §15: T=6, E=4, K=2 softmax-post routing.
REFERENCE_EXPERTS_BY_TOKEN = {0: (0, 1), 1: (1, 2), 2: (1, 3), 3: (1, 2), 4: (0, 2), 5: (2, 3)}


def _reference_probs() -> torch.Tensor:
    probs = torch.zeros(6, 4)
    for token, by_expert in SOFTMAX_POST_PROBS.items():
        for expert, prob in by_expert.items():
            probs[token, expert] = prob
    return probs


def _map_from_expert_sets(num_tokens: int, tokens_by_expert: list[set[int]]) -> torch.Tensor:
    routing_map = torch.zeros(num_tokens, len(tokens_by_expert), dtype=torch.bool)
    for expert, expert_tokens in enumerate(tokens_by_expert):
        routing_map[sorted(expert_tokens), expert] = True
    return routing_map


@st.composite
def routing_maps(draw, max_tokens: int = 64, max_experts: int = 16) -> torch.Tensor:
    """Random [T, E] bool maps; density is drawn too so empty rows and empty experts are common."""
    num_tokens = draw(st.integers(1, max_tokens))
    num_experts = draw(st.integers(1, max_experts))
    density = draw(st.sampled_from([0.0, 0.05, 0.2, 0.5, 0.9, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(num_tokens, num_experts, generator=generator) < density


def _random_inputs(routing_map: torch.Tensor, hidden: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(int(routing_map.sum()) + routing_map.numel())
    tokens = torch.randn(routing_map.shape[0], hidden, generator=generator)
    probs = torch.rand(routing_map.shape, generator=generator) * routing_map
    return tokens, probs


def _naive_order(routing_map: torch.Tensor) -> list[int]:
    """Upstream order written out: loop experts, then tokens ascending."""
    num_tokens, num_experts = routing_map.shape
    return [t for e in range(num_experts) for t in range(num_tokens) if routing_map[t, e]]


# ---------------------------------------------------------------------------------- reference values


def test_permute_matches_upstream_reference_order():
    routing_map = torch.zeros(6, 4, dtype=torch.bool)
    for token, experts in REFERENCE_EXPERTS_BY_TOKEN.items():
        routing_map[token, list(experts)] = True
    probs = _reference_probs()
    tokens = torch.arange(6, dtype=torch.float32).unsqueeze(1).repeat(1, 3)

    permuted, permuted_probs, sorted_indices = permute(tokens, routing_map, probs, num_out_tokens=12)

    assert sorted_indices.tolist() == [0, 4, 0, 1, 2, 3, 1, 3, 4, 5, 2, 5]
    assert sorted_indices.dtype == torch.int64
    assert tokens_per_expert(routing_map).tolist() == [2, 4, 4, 2]
    torch.testing.assert_close(permuted, tokens[sorted_indices], atol=EXACT, rtol=EXACT)
    expected_probs = torch.tensor(
        [0.7311, 0.5250, 0.2689, 0.5250, 0.8808, 0.1192, 0.4750, 0.8808, 0.4750, 0.1192, 0.1192, 0.8808]
    )
    torch.testing.assert_close(permuted_probs, expected_probs, atol=EXACT, rtol=EXACT)
    # Counting the rows ourselves (host sync) gives the same result.
    assert permute(tokens, routing_map)[2].tolist() == sorted_indices.tolist()


def test_drop_and_pad_matches_upstream_reference():
    # Map after capacity dropping with pad (cf=1.0, cap=3, probs policy) as upstream produced it:
    # expert 0 and 3 got filler token 3 (prob 0).
    routing_map = _map_from_expert_sets(6, [{0, 3, 4}, {0, 1, 2}, {1, 3, 4}, {2, 3, 5}])
    probs = _reference_probs() * routing_map
    tokens = torch.randn(6, 5)
    capacity = 3

    permuted, permuted_probs, sorted_indices = permute(
        tokens, routing_map, probs, num_out_tokens=capacity * 4, drop_and_pad=True
    )

    assert sorted_indices.tolist() == [0, 3, 4, 0, 1, 2, 1, 3, 4, 2, 3, 5]
    expected_probs = torch.tensor(
        [0.7311, 0.0, 0.5250, 0.2689, 0.5250, 0.8808, 0.4750, 0.8808, 0.4750, 0.1192, 0.0, 0.8808]
    )
    torch.testing.assert_close(permuted_probs, expected_probs, atol=EXACT, rtol=EXACT)
    torch.testing.assert_close(permuted, tokens[sorted_indices], atol=EXACT, rtol=EXACT)
    # Each expert has exactly `capacity` rows and every non-zero prob of its column is among them.
    for expert, block in enumerate(sorted_indices.view(4, capacity).tolist()):
        assert len(block) == capacity
        assert set(torch.nonzero(probs[:, expert]).flatten().tolist()) <= set(block)


def test_drop_and_pad_fills_short_experts_with_lowest_unmarked_tokens():
    # Dropped but not padded: experts 0 and 3 have 2 marks for capacity 3.
    routing_map = _map_from_expert_sets(6, [{0, 4}, {0, 1, 2}, {1, 3, 4}, {2, 5}])
    probs = _reference_probs() * routing_map
    _, permuted_probs, sorted_indices = permute(
        torch.randn(6, 2), routing_map, probs, num_out_tokens=12, drop_and_pad=True
    )
    # Marked rows first (ascending), then the lowest unmarked token; fillers carry prob 0.
    assert sorted_indices.tolist() == [0, 4, 1, 0, 1, 2, 1, 3, 4, 2, 5, 0]
    assert permuted_probs[[2, 11]].tolist() == [0.0, 0.0]


def test_drop_and_pad_keeps_first_capacity_marked_tokens_when_over_capacity():
    routing_map = _map_from_expert_sets(5, [{1, 2, 3, 4}, set()])
    _, _, sorted_indices = permute(torch.randn(5, 2), routing_map, num_out_tokens=4, drop_and_pad=True)
    assert sorted_indices.tolist() == [1, 2, 0, 1]


def test_pad_routing_map_matches_upstream_reference():
    routing_map = _map_from_expert_sets(6, [{0, 3}, {5}, set()])
    padded = pad_routing_map(routing_map, 4)
    expected = _map_from_expert_sets(6, [{0, 1, 2, 3}, {0, 1, 2, 5}, set()])
    assert torch.equal(padded, expected)
    assert not torch.equal(routing_map, padded), "the input map must not be modified in place"
    assert tokens_per_expert(padded).tolist() == [4, 4, 0]


# ---------------------------------------------------------------------------------- properties


@HYPOTHESIS_SETTINGS
@given(routing_map=routing_maps())
def test_permute_order_matches_naive_loop(routing_map):
    tokens, probs = _random_inputs(routing_map)
    num_routed = int(routing_map.sum())
    permuted, permuted_probs, sorted_indices = permute(tokens, routing_map, probs, num_out_tokens=num_routed)

    assert sorted_indices.tolist() == _naive_order(routing_map)
    torch.testing.assert_close(permuted, tokens[sorted_indices], atol=EXACT, rtol=EXACT)
    experts_of_rows = torch.repeat_interleave(
        torch.arange(routing_map.shape[1]), tokens_per_expert(routing_map)
    )
    torch.testing.assert_close(permuted_probs, probs[sorted_indices, experts_of_rows], atol=EXACT, rtol=EXACT)


@HYPOTHESIS_SETTINGS
@given(routing_map=routing_maps())
def test_unpermute_with_unit_probs_counts_copies(routing_map):
    tokens, _ = _random_inputs(routing_map)
    permuted, _, sorted_indices = permute(tokens, routing_map)
    ones = torch.ones(sorted_indices.shape[0])
    restored = unpermute(permuted, sorted_indices, tokens.shape[0], probs=ones)
    expected = tokens * routing_map.sum(dim=1, keepdim=True)
    torch.testing.assert_close(restored, expected, atol=FP32_OUTPUT_ATOL, rtol=FP32_OUTPUT_RTOL)


@HYPOTHESIS_SETTINGS
@given(routing_map=routing_maps())
def test_permute_unpermute_with_probs_is_weighted_sum(routing_map):
    tokens, probs = _random_inputs(routing_map)
    permuted, permuted_probs, sorted_indices = permute(tokens, routing_map, probs)
    restored = unpermute(permuted, sorted_indices, tokens.shape[0], probs=permuted_probs)
    expected = tokens * probs.sum(dim=1, keepdim=True)  # sum_k p_tk x_t
    torch.testing.assert_close(restored, expected, atol=FP32_OUTPUT_ATOL, rtol=FP32_OUTPUT_RTOL)


@HYPOTHESIS_SETTINGS
@given(routing_map=routing_maps())
def test_permute_gradients_match_dense_reference(routing_map):
    tokens, probs = _random_inputs(routing_map)
    expert_weights = torch.randn(
        routing_map.shape[1], tokens.shape[1], generator=torch.Generator().manual_seed(1)
    )

    tokens_a = tokens.clone().requires_grad_()
    probs_a = probs.clone().requires_grad_()
    permuted, permuted_probs, _ = permute(
        tokens_a, routing_map, probs_a, num_out_tokens=int(routing_map.sum())
    )
    experts_of_rows = torch.repeat_interleave(
        torch.arange(routing_map.shape[1]), tokens_per_expert(routing_map)
    )
    loss = ((permuted * expert_weights[experts_of_rows]).sum(dim=1) * permuted_probs).sum()
    loss.backward()

    # Dense oracle: sum over routed (t, e) of p_te <x_t, w_e>.
    tokens_b = tokens.clone().requires_grad_()
    probs_b = probs.clone().requires_grad_()
    dense_loss = torch.einsum("te,te,th,eh->", routing_map.float(), probs_b, tokens_b, expert_weights)
    dense_loss.backward()

    # A sum of up to T*E terms that cancel: fp32 rounding scales with the sum of their magnitudes,
    # not with the (possibly small) result.
    magnitude = torch.einsum("te,te,th,eh->", routing_map.float(), probs.abs(), tokens.abs(), expert_weights.abs())
    torch.testing.assert_close(
        loss, dense_loss, atol=max(FP32_OUTPUT_ATOL, FP32_SCALAR_SUM_RTOL * magnitude.item()), rtol=FP32_SCALAR_SUM_RTOL
    )
    torch.testing.assert_close(tokens_a.grad, tokens_b.grad, atol=FP32_GRAD_ATOL, rtol=0)
    # Unrouted entries of probs get no gradient from permute (upstream gathers routed entries only).
    torch.testing.assert_close(probs_a.grad, probs_b.grad * routing_map, atol=FP32_GRAD_ATOL, rtol=0)


@HYPOTHESIS_SETTINGS
@given(routing_map=routing_maps())
def test_unpermute_gradients_match_dense_reference(routing_map):
    tokens, probs = _random_inputs(routing_map)
    _, permuted_probs, sorted_indices = permute(tokens, routing_map, probs)
    num_rows, num_tokens = sorted_indices.shape[0], tokens.shape[0]
    generator = torch.Generator().manual_seed(2)
    rows = torch.randn(num_rows, tokens.shape[1], generator=generator)
    upstream_grad = torch.randn(num_tokens, tokens.shape[1], generator=generator)

    rows_a = rows.clone().requires_grad_()
    probs_a = permuted_probs.clone().requires_grad_()
    restored = unpermute(rows_a, sorted_indices, num_tokens, probs=probs_a)
    (restored * upstream_grad).sum().backward()

    # Dense oracle: a [rows, tokens] one-hot scatter matrix.
    scatter = torch.nn.functional.one_hot(sorted_indices, num_tokens).float()
    rows_b = rows.clone().requires_grad_()
    probs_b = permuted_probs.clone().requires_grad_()
    dense = scatter.T @ (rows_b * probs_b.unsqueeze(-1))
    (dense * upstream_grad).sum().backward()

    torch.testing.assert_close(restored, dense, atol=FP32_OUTPUT_ATOL, rtol=FP32_OUTPUT_RTOL)
    torch.testing.assert_close(rows_a.grad, rows_b.grad, atol=FP32_GRAD_ATOL, rtol=0)
    torch.testing.assert_close(probs_a.grad, probs_b.grad, atol=FP32_GRAD_ATOL, rtol=0)


@HYPOTHESIS_SETTINGS
@given(routing_map=routing_maps(), capacity_fraction=st.floats(0.0, 1.0))
def test_drop_and_pad_shapes_and_order(routing_map, capacity_fraction):
    num_tokens, num_experts = routing_map.shape
    capacity = int(capacity_fraction * num_tokens)
    tokens, probs = _random_inputs(routing_map)
    permuted, permuted_probs, sorted_indices = permute(
        tokens, routing_map, probs, num_out_tokens=capacity * num_experts, drop_and_pad=True
    )
    assert permuted.shape == (capacity * num_experts, tokens.shape[1])
    assert permuted_probs.shape == sorted_indices.shape == (capacity * num_experts,)
    for expert, block in enumerate(sorted_indices.view(num_experts, capacity).tolist()):
        marked = [t for t in range(num_tokens) if routing_map[t, expert]]
        unmarked = [t for t in range(num_tokens) if not routing_map[t, expert]]
        assert block == (marked + unmarked)[:capacity]


@HYPOTHESIS_SETTINGS
@given(routing_map=routing_maps(), alignment=st.integers(1, 8))
def test_pad_routing_map_properties(routing_map, alignment):
    padded = pad_routing_map(routing_map, alignment)
    num_tokens = routing_map.shape[0]
    assert padded.dtype == torch.bool and padded.shape == routing_map.shape
    assert bool((padded | ~routing_map).all()), "every original assignment is kept"
    for expert in range(routing_map.shape[1]):
        count = int(routing_map[:, expert].sum())
        zeros = [t for t in range(num_tokens) if not routing_map[t, expert]]
        flips = [t for t in range(num_tokens) if padded[t, expert] and not routing_map[t, expert]]
        assert flips == zeros[: (-count) % alignment], "flips are the lowest-index zeros"
        if (-count) % alignment <= len(zeros):
            assert int(padded[:, expert].sum()) % alignment == 0


# ---------------------------------------------------------------------------------- dtypes, errors


def test_unpermute_accumulates_in_fp32_with_fp32_probs_and_returns_input_dtype():
    tokens = torch.randn(4, 3).to(torch.bfloat16)
    routing_map = torch.tensor([[True, True], [True, False], [False, True], [False, False]])
    probs = torch.rand(4, 2) * routing_map
    permuted, permuted_probs, sorted_indices = permute(tokens, routing_map, probs, num_out_tokens=4)
    restored = unpermute(permuted, sorted_indices, 4, probs=permuted_probs)
    assert restored.dtype == torch.bfloat16
    # One rounding to bf16 at the end, as upstream: equals the fp32 sum rounded once.
    expected = (tokens.float() * probs.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    torch.testing.assert_close(restored, expected, atol=EXACT, rtol=EXACT)


def test_invalid_inputs_raise():
    tokens = torch.randn(4, 3)
    routing_map = torch.zeros(4, 2, dtype=torch.bool)
    with pytest.raises(TypeError, match="must be a bool tensor"):
        permute(tokens, routing_map.int())
    with pytest.raises(ValueError, match="tokens has 3 rows but routing_map has 4"):
        permute(tokens[:3], routing_map)
    with pytest.raises(ValueError, match="probs has shape"):
        permute(tokens, routing_map, torch.zeros(4, 3))
    with pytest.raises(ValueError, match="num_out_tokens=9 must be between"):
        permute(tokens, routing_map, num_out_tokens=9)
    with pytest.raises(ValueError, match="drop_and_pad=True needs num_out_tokens"):
        permute(tokens, routing_map, drop_and_pad=True)
    with pytest.raises(ValueError, match="divisible by num_experts=2"):
        permute(tokens, routing_map, num_out_tokens=3, drop_and_pad=True)
    with pytest.raises(ValueError, match="num_out_tokens=6 must be between 0 and tokens"):
        permute(tokens[:2], routing_map[:2], num_out_tokens=6, drop_and_pad=True)
    with pytest.raises(ValueError, match="sorted_indices has shape"):
        unpermute(tokens, torch.zeros(3, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match=r"probs has shape \(2,\)"):
        unpermute(tokens, torch.zeros(4, dtype=torch.int64), 4, probs=torch.ones(2))
    with pytest.raises(ValueError, match="alignment must be >= 1"):
        pad_routing_map(routing_map, 0)
    with pytest.raises(ValueError, match=r"shape \[tokens, experts\]"):
        tokens_per_expert(torch.zeros(4, dtype=torch.bool))
