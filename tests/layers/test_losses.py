"""Tests of `lightning_moe.layers.losses` against upstream reference values and closed forms."""

from __future__ import annotations

import math

import pytest
import torch
from layers.reference_values import REFERENCE_LOGITS

from lightning_moe.layers import losses

# Reference values of docs/numerics.md §15 are printed with 4-7 significant digits.
REFERENCE_ATOL = 1e-4
# Loss values recomputed in fp32 by a different summation order: a few ulps of O(1e-2) numbers.
FP32_LOSS_ATOL = 1e-6
# Gradients through softmax / logsumexp in fp32 compared with an autograd oracle.
FP32_GRAD_ATOL = 1e-6

TOP_K = 2
NUM_EXPERTS = 4


def _closed_form_switch_loss(scores: torch.Tensor, routing_map: torch.Tensor, coeff: float) -> float:
    """``coeff * E * sum_i f_i * P_i`` written out with Python floats."""
    num_tokens, num_experts = scores.shape
    total = 0.0
    for expert in range(num_experts):
        fraction = routing_map[:, expert].sum().item() / (num_tokens * TOP_K)
        mean_prob = scores[:, expert].sum().item() / num_tokens
        total += fraction * mean_prob
    return coeff * num_experts * total


def test_aux_loss_reference_value_and_counts():
    scores, routing_map = losses.aux_loss_scores(REFERENCE_LOGITS, TOP_K, "softmax")
    counts = routing_map.sum(dim=0)
    assert counts.tolist() == [2, 4, 4, 2]
    loss = losses.aux_loss(scores, counts, TOP_K, coeff=0.01)
    assert loss.item() == pytest.approx(0.0101707, abs=REFERENCE_ATOL)
    assert loss.item() == pytest.approx(
        _closed_form_switch_loss(scores, routing_map, 0.01), abs=FP32_LOSS_ATOL
    )


def test_switch_loss_shares_sum_to_group_loss():
    # Two "ranks" each hold half the tokens; counts are the group's. Their values sum to the loss.
    scores, routing_map = losses.aux_loss_scores(REFERENCE_LOGITS, TOP_K, "softmax")
    counts = routing_map.sum(dim=0)
    shares = [
        losses.switch_load_balancing_loss(scores[rows], counts, 6, TOP_K, NUM_EXPERTS, 0.01)
        for rows in (slice(0, 3), slice(3, 6))
    ]
    assert sum(shares).item() == pytest.approx(0.0101707, abs=REFERENCE_ATOL)
    first_rank = losses.aux_loss(scores[:3], counts, TOP_K, 0.01, group_size=2)
    assert first_rank.item() == pytest.approx(shares[0].item(), abs=FP32_LOSS_ATOL)


@pytest.mark.parametrize("score_func", ["sigmoid", "sqrtsoftplus"])
def test_aux_loss_scores_normalise_non_softmax_scores(score_func):
    scores, routing_map = losses.aux_loss_scores(REFERENCE_LOGITS, TOP_K, score_func)
    raw = (
        torch.sigmoid(REFERENCE_LOGITS)
        if score_func == "sigmoid"
        else torch.sqrt(torch.log1p(REFERENCE_LOGITS.exp()))
    )
    torch.testing.assert_close(scores, raw / raw.sum(-1, keepdim=True), atol=FP32_LOSS_ATOL, rtol=0)
    assert routing_map.sum(dim=1).tolist() == [TOP_K] * 6


def test_aux_loss_scores_zero_padded_rows():
    padding_mask = torch.tensor([False, True, False, False, True, False])
    scores, routing_map = losses.aux_loss_scores(REFERENCE_LOGITS, TOP_K, "softmax", padding_mask)
    assert scores[padding_mask].abs().sum() == 0
    assert not routing_map[padding_mask].any()
    assert routing_map[~padding_mask].sum(dim=1).tolist() == [TOP_K] * 4


def test_aux_loss_with_padding_equals_loss_of_valid_tokens():
    padding_mask = torch.tensor([False, True, False, False, True, False])
    scores, routing_map = losses.aux_loss_scores(REFERENCE_LOGITS, TOP_K, "softmax", padding_mask)
    masked = losses.aux_loss(scores, routing_map.sum(0), TOP_K, 0.01, with_padding_mask=True)
    valid_scores, valid_map = losses.aux_loss_scores(REFERENCE_LOGITS[~padding_mask], TOP_K, "softmax")
    expected = losses.aux_loss(valid_scores, valid_map.sum(0), TOP_K, 0.01)
    assert masked.item() == pytest.approx(expected.item(), abs=FP32_LOSS_ATOL)


def test_aux_loss_of_only_padding_is_zero_not_nan():
    padding_mask = torch.ones(6, dtype=torch.bool)
    scores, routing_map = losses.aux_loss_scores(REFERENCE_LOGITS, TOP_K, "softmax", padding_mask)
    loss = losses.aux_loss(scores, routing_map.sum(0), TOP_K, 0.01, with_padding_mask=True)
    assert loss.item() == 0.0


def test_aux_loss_scores_rejects_unknown_score_function():
    with pytest.raises(ValueError, match="Unknown score_func 'relu'"):
        losses.aux_loss_scores(REFERENCE_LOGITS, TOP_K, "relu")


def test_z_loss_reference_value():
    loss = losses.z_loss(REFERENCE_LOGITS, 1e-3)
    assert loss.item() == pytest.approx(0.0064587, abs=REFERENCE_ATOL)
    expected = 1e-3 * torch.logsumexp(REFERENCE_LOGITS, -1).square().mean().item()
    assert loss.item() == pytest.approx(expected, abs=FP32_LOSS_ATOL)


def test_z_loss_divides_by_tp_cp_size_and_ignores_padding():
    padding_mask = torch.tensor([True, False, False, False, False, True])
    masked = losses.z_loss(REFERENCE_LOGITS, 1e-3, padding_mask, tp_cp_size=2)
    expected = losses.z_loss(REFERENCE_LOGITS[~padding_mask], 1e-3) / 2
    assert masked.item() == pytest.approx(expected.item(), abs=FP32_LOSS_ATOL)
    all_padding = torch.ones(6, dtype=torch.bool)
    assert losses.z_loss(REFERENCE_LOGITS, 1e-3, all_padding).item() == 0.0


def _reference_logits_b_major(seq_len: int = 3, batch: int = 2) -> torch.Tensor:
    """Upstream orders tokens t = s * B + b; ours are t = b * S + s."""
    return REFERENCE_LOGITS.view(seq_len, batch, NUM_EXPERTS).transpose(0, 1).reshape(-1, NUM_EXPERTS)


def _seq_aux(
    logits: torch.Tensor, num_sequences: int, coeff: float = 0.01, padding_mask=None
) -> torch.Tensor:
    scores, routing_map = losses.aux_loss_scores(logits, TOP_K, "softmax", padding_mask)
    counts = losses.tokens_per_sequence_and_expert(routing_map, num_sequences)
    return losses.seq_aux_loss(
        scores, counts, num_sequences, TOP_K, coeff, with_padding_mask=padding_mask is not None
    )


def test_seq_aux_loss_reference_value_in_b_major_order():
    logits = _reference_logits_b_major()
    loss = _seq_aux(logits, num_sequences=2)
    assert loss.item() == pytest.approx(0.0114220, abs=REFERENCE_ATOL)
    # It is the mean of the per-sequence Switch losses.
    per_sequence = [_seq_aux(logits[b * 3 : (b + 1) * 3], num_sequences=1) for b in range(2)]
    assert loss.item() == pytest.approx(sum(per_sequence).item() / 2, abs=FP32_LOSS_ATOL)


def test_seq_aux_loss_with_one_sequence_equals_aux_loss():
    scores, routing_map = losses.aux_loss_scores(REFERENCE_LOGITS, TOP_K, "softmax")
    expected = losses.aux_loss(scores, routing_map.sum(0), TOP_K, 0.01)
    assert _seq_aux(REFERENCE_LOGITS, num_sequences=1).item() == pytest.approx(
        expected.item(), abs=FP32_LOSS_ATOL
    )


def test_seq_aux_loss_with_equal_padding_per_sequence_equals_truncated_sequences():
    logits = torch.randn(2 * 5, NUM_EXPERTS)
    padding_mask = torch.tensor([False, False, False, True, True] * 2)
    masked = _seq_aux(logits, 2, padding_mask=padding_mask)
    truncated = _seq_aux(logits[~padding_mask], 2)
    assert masked.item() == pytest.approx(truncated.item(), abs=FP32_LOSS_ATOL)


def test_global_aux_loss_of_one_micro_batch_equals_aux_loss():
    scores, routing_map = losses.aux_loss_scores(REFERENCE_LOGITS, TOP_K, "softmax")
    counts = routing_map.sum(0)
    loss = losses.global_aux_loss(scores, counts.float(), counts, TOP_K, 0.01)
    assert loss.item() == pytest.approx(0.0101707, abs=REFERENCE_ATOL)
    # As a share of a 2-rank group (other rank with identical tokens): half the value.
    share = losses.global_aux_loss(scores, 2.0 * counts, 2 * counts, TOP_K, 0.01, group_size=2)
    assert share.item() == pytest.approx(loss.item() / 2, abs=FP32_LOSS_ATOL)


def test_scaler_gives_the_loss_gradient_scale_and_passes_the_main_gradient():
    # Reference 2.13: scale 0.25 and aux = 3a -> d/da = 0.75; the main gradient is unchanged.
    a = torch.tensor(2.0, requires_grad=True)
    x = torch.tensor([1.0, -1.0, 0.5], requires_grad=True)
    out = losses.attach_loss(x * 1.0, 3 * a, 0.25)
    torch.testing.assert_close(out, x.detach(), atol=0, rtol=0)
    (out * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert a.grad.item() == pytest.approx(0.75, abs=REFERENCE_ATOL)
    torch.testing.assert_close(x.grad, torch.tensor([1.0, 2.0, 3.0]), atol=0, rtol=0)


def test_scaler_accepts_a_tensor_scale():
    a = torch.tensor(1.0, requires_grad=True)
    out = losses.attach_loss(torch.ones(2, requires_grad=True), a * a, torch.tensor(0.5))
    out.sum().backward()
    assert a.grad.item() == pytest.approx(1.0, abs=FP32_GRAD_ATOL)


def test_attached_z_loss_gradient_equals_adding_it_to_the_objective():
    logits = REFERENCE_LOGITS.clone().requires_grad_()
    scale = 0.3
    weights = torch.randn(6, NUM_EXPERTS)
    attached = losses.attach_loss(logits, losses.z_loss(logits, 1e-3), scale)
    (attached * weights).sum().backward()
    oracle_logits = REFERENCE_LOGITS.clone().requires_grad_()
    objective = (oracle_logits * weights).sum() + scale * 1e-3 * torch.logsumexp(
        oracle_logits, -1
    ).square().mean()
    (expected,) = torch.autograd.grad(objective, oracle_logits)
    torch.testing.assert_close(logits.grad, expected, atol=FP32_GRAD_ATOL, rtol=0)


def test_switch_loss_accepts_tensor_token_count():
    scores, routing_map = losses.aux_loss_scores(REFERENCE_LOGITS, TOP_K, "softmax")
    counts = routing_map.sum(0)
    loss = losses.switch_load_balancing_loss(scores, counts, torch.tensor(6.0), TOP_K, NUM_EXPERTS, 0.01)
    assert math.isclose(loss.item(), 0.0101707, abs_tol=REFERENCE_ATOL)
