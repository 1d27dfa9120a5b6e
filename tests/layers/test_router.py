"""Tests of `TopKRouter`: reference values, loss gradients, side effects, dtypes and reductions."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.recorders import GemmDtypes
from layers.reference_values import REFERENCE_LOGITS
from torch.utils.checkpoint import checkpoint

from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.moe import MoELayer
from lightning_moe.layers.router import (
    LOGGED_LOSS_NAMES,
    RouterReduction,
    TopKRouter,
    topk_routing,
    update_expert_bias,
)

# Reference values of docs/numerics.md §15 are printed with 4-7 significant digits.
REFERENCE_ATOL = 1e-4
# fp32 loss values recomputed in another summation order.
FP32_LOSS_ATOL = 1e-6
# fp32 gradients through softmax/logsumexp and one [T]x[H] reduction, against an autograd oracle.
FP32_GRAD_ATOL = 1e-6
# Sample std of 16k normal draws: its relative standard error is about 1/sqrt(2 * 16384) = 0.6%.
INIT_STD_RTOL = 0.05
# fp32 routing probabilities of the same logits computed twice: a few ulps of O(1) numbers.
FP32_PROB_ATOL = 1e-6


def _router(hidden_size: int = 4, identity_weight: bool = True, **overrides) -> TopKRouter:
    """A training-mode router with E=4, K=2; with an identity weight its logits equal its input."""
    settings = {"hidden_size": hidden_size, "ffn_hidden_size": 8, "num_experts": 4, "top_k": 2, **overrides}
    router = TopKRouter(MoEConfig(**settings))
    if identity_weight:
        with torch.no_grad():
            router.weight.copy_(torch.eye(4, hidden_size))
    return router.train()


ALL_LOSSES = {"load_balancing": ["aux_loss", "seq_aux_loss", "global_aux_loss"], "z_loss_coeff": 1e-3}


def test_router_reproduces_reference_routing_and_logged_losses():
    router = _router(load_balancing=["aux_loss"], aux_loss_coeff=0.01, z_loss_coeff=1e-3)
    probs, routing_map = router(REFERENCE_LOGITS)
    expected, _ = topk_routing(REFERENCE_LOGITS, 2)
    torch.testing.assert_close(probs, expected, atol=0, rtol=0)
    assert routing_map.sum(0).tolist() == [2, 4, 4, 2]
    logged = router.logged_losses()
    assert logged["load_balancing_loss"].item() == pytest.approx(0.0101707 / 0.01, abs=REFERENCE_ATOL / 0.01)
    assert logged["z_loss"].item() == pytest.approx(0.0064587 / 1e-3, abs=REFERENCE_ATOL / 1e-3)
    assert router.logged_losses() == {}  # reset by the first read


def test_router_seq_aux_loss_reference_in_b_major_order():
    # Upstream token t = s * B + b with S=3, B=2; our rows are t = b * S + s.
    b_major = REFERENCE_LOGITS.view(3, 2, 4).transpose(0, 1).reshape(6, 4)
    router = _router(load_balancing=["seq_aux_loss"], aux_loss_coeff=0.01)
    router(b_major, num_sequences=2)
    logged = router.logged_losses(reset=False)["seq_load_balancing_loss"].item()
    assert logged == pytest.approx(0.0114220 / 0.01, abs=REFERENCE_ATOL / 0.01)
    assert set(router.logged_losses()) == {"seq_load_balancing_loss"}


def test_router_uses_expert_bias_for_selection_only():
    router = _router(score_func="sigmoid", expert_bias=True, topk_scaling_factor=2.5)
    router.expert_bias.copy_(torch.tensor([0.0, -1.0, 0.0, 0.5]))
    probs, _ = router(REFERENCE_LOGITS)
    assert probs[0].tolist() == pytest.approx([1.9152, 0.0, 0.0, 0.5848], abs=REFERENCE_ATOL)
    assert probs[1].tolist() == pytest.approx([0.0, 0.0, 1.3093, 1.1907], abs=REFERENCE_ATOL)


def _switch_loss(scores, routing_map, coeff, top_k=2):
    """Independent oracle of the Switch loss on one group of tokens: coeff * E * sum f_i P_i."""
    num_tokens, num_experts = scores.shape
    fraction = routing_map.sum(0) / (num_tokens * top_k)
    return coeff * num_experts * (fraction * scores.mean(0)).sum()


def test_loss_gradients_equal_adding_scaled_losses_to_the_objective():
    num_sequences, seq_len, hidden_size, scale = 2, 4, 6, 0.5
    coeffs = [0.01, 0.02, 0.03]
    router = _router(hidden_size, identity_weight=False, **{**ALL_LOSSES, "aux_loss_coeff": coeffs})
    router.aux_loss_scale = scale
    hidden = torch.randn(num_sequences * seq_len, hidden_size, requires_grad=True)
    main_weights = torch.randn(num_sequences * seq_len, 4)
    probs, _ = router(hidden, num_sequences=num_sequences)
    (probs * main_weights).sum().backward()

    weight = router.weight.detach().clone().requires_grad_()
    oracle_hidden = hidden.detach().clone().requires_grad_()
    logits = oracle_hidden @ weight.T
    oracle_probs, _ = topk_routing(logits, 2)
    scores = torch.softmax(logits, -1)
    aux_map = torch.zeros_like(scores).scatter(1, scores.topk(2).indices, 1.0)
    per_sequence = [
        _switch_loss(
            scores[b * seq_len : (b + 1) * seq_len], aux_map[b * seq_len : (b + 1) * seq_len], coeffs[1]
        )
        for b in range(num_sequences)
    ]
    side_losses = (
        _switch_loss(scores, aux_map, coeffs[0])
        + sum(per_sequence) / num_sequences
        + _switch_loss(scores, aux_map, coeffs[2])  # global == micro-batch loss for one micro-batch, DP=1
        + 1e-3 * torch.logsumexp(logits, -1).square().mean()
    )
    objective = (oracle_probs * main_weights).sum() + scale * side_losses
    expected_weight_grad, expected_hidden_grad = torch.autograd.grad(objective, (weight, oracle_hidden))
    torch.testing.assert_close(router.weight.grad, expected_weight_grad, atol=FP32_GRAD_ATOL, rtol=0)
    torch.testing.assert_close(hidden.grad, expected_hidden_grad, atol=FP32_GRAD_ATOL, rtol=0)


def _side_effect_state(router: TopKRouter) -> tuple[list[int], list[int], int]:
    return (
        router.local_tokens_per_expert.tolist(),
        router.logged_loss_counts.tolist(),
        router.global_aux_loss_steps.item(),
    )


def test_side_effects_only_in_training_with_grad():
    router = _router(**ALL_LOSSES, aux_loss_coeff=0.01)
    with torch.no_grad():
        router(REFERENCE_LOGITS)
    router.eval()
    router(REFERENCE_LOGITS)
    assert _side_effect_state(router) == ([0, 0, 0, 0], [0, 0, 0, 0], 0)
    router.train()
    router(REFERENCE_LOGITS)
    assert _side_effect_state(router) == ([2, 4, 4, 2], [1, 1, 1, 1], 1)


def test_side_effects_once_under_reentrant_checkpoint():
    router = _router(**ALL_LOSSES, aux_loss_coeff=0.01)
    hidden = REFERENCE_LOGITS.clone().requires_grad_()
    main_weights = torch.randn(6, 4)
    probs, _ = checkpoint(router, hidden, use_reentrant=True)
    assert _side_effect_state(router) == ([0, 0, 0, 0], [0, 0, 0, 0], 0)  # forward ran under no_grad
    (probs * main_weights).sum().backward()
    assert _side_effect_state(router) == ([2, 4, 4, 2], [1, 1, 1, 1], 1)  # recompute counted once
    # The losses attached during the recompute reach the gradients like a plain forward's.
    plain_router = _router(**ALL_LOSSES, aux_loss_coeff=0.01)
    plain_hidden = REFERENCE_LOGITS.clone().requires_grad_()
    (plain_router(plain_hidden)[0] * main_weights).sum().backward()
    torch.testing.assert_close(router.weight.grad, plain_router.weight.grad, atol=FP32_GRAD_ATOL, rtol=0)
    torch.testing.assert_close(hidden.grad, plain_hidden.grad, atol=FP32_GRAD_ATOL, rtol=0)


def test_expert_bias_stays_fp32_under_model_casts_and_state_dict():
    router = _router(score_func="sigmoid", expert_bias=True)
    router.expert_bias.copy_(torch.tensor([1e-3, -2e-3, 3e-3, 0.0]))
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to(dtype=torch.bfloat16)):
        cast(router)
        assert router.expert_bias.dtype == torch.float32
        assert router.logged_loss_sums.dtype == torch.float32
    assert router.weight.dtype == torch.bfloat16
    torch.testing.assert_close(router.expert_bias, torch.tensor([1e-3, -2e-3, 3e-3, 0.0]), atol=0, rtol=0)
    state = router.state_dict()
    assert set(state) == {"weight", "expert_bias"}
    assert state["expert_bias"].dtype == torch.float32
    probs, _ = router(REFERENCE_LOGITS.bfloat16())
    assert probs.dtype == torch.float32  # router_dtype fp32 whatever the model dtype


def test_state_dict_without_expert_bias_holds_only_the_weight():
    assert set(_router().state_dict()) == {"weight"}


def test_padded_tokens_are_routed_but_excluded_from_losses_and_counts():
    padding_mask = torch.tensor([False, True, False, False, True, False])
    router = _router(load_balancing=["aux_loss"], aux_loss_coeff=0.01, z_loss_coeff=1e-3)
    _, routing_map = router(REFERENCE_LOGITS, padding_mask=padding_mask)
    assert routing_map.sum(1).tolist() == [2] * 6
    assert router.local_tokens_per_expert.tolist() == routing_map[~padding_mask].sum(0).tolist()
    valid_only = _router(load_balancing=["aux_loss"], aux_loss_coeff=0.01, z_loss_coeff=1e-3)
    valid_only(REFERENCE_LOGITS[~padding_mask])
    masked_logged, valid_logged = router.logged_losses(), valid_only.logged_losses()
    for name in ("load_balancing_loss", "z_loss"):
        assert masked_logged[name].item() == pytest.approx(valid_logged[name].item(), abs=FP32_LOSS_ATOL)


def _doubling(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over a fake group of two ranks that hold identical tokens."""
    return tensor * 2


def _loss_only_weight_grad(router: TopKRouter, padding_mask=None) -> torch.Tensor:
    probs, _ = router(REFERENCE_LOGITS, padding_mask=padding_mask)
    (probs * 0.0).sum().backward()  # the main objective contributes nothing: only attached losses
    return router.weight.grad


@pytest.mark.parametrize("padding_mask", [None, torch.tensor([False, True, False, False, False, True])])
def test_tp_cp_reduction_makes_each_rank_hold_half_the_loss(padding_mask):
    settings = {"load_balancing": ["aux_loss", "seq_aux_loss"], "aux_loss_coeff": 0.01, "z_loss_coeff": 1e-3}
    single, pair = _router(**settings), _router(**settings)
    pair.reduction = RouterReduction(
        sum_tp_cp=_doubling, tp_cp_size=2, sum_tp_dp_cp=_doubling, tp_dp_cp_size=2
    )
    single_grad = _loss_only_weight_grad(single, padding_mask)
    pair_grad = _loss_only_weight_grad(pair, padding_mask)
    single_logged, pair_logged = single.logged_losses(), pair.logged_losses()
    for name in ("load_balancing_loss", "seq_load_balancing_loss"):
        assert pair_logged[name].item() == pytest.approx(single_logged[name].item() / 2, abs=FP32_LOSS_ATOL)
    assert pair_logged["z_loss"].item() == pytest.approx(single_logged["z_loss"].item(), abs=FP32_LOSS_ATOL)
    # Both ranks' router grads are summed over TP x CP: together they equal the single device's.
    torch.testing.assert_close(2 * pair_grad, single_grad, atol=FP32_GRAD_ATOL, rtol=0)


def test_global_aux_loss_under_dp_keeps_the_single_device_gradient():
    settings = {"load_balancing": ["global_aux_loss"], "aux_loss_coeff": 0.01}
    single, dp_rank = _router(**settings), _router(**settings)
    dp_rank.reduction = RouterReduction(sum_tp_dp_cp=_doubling, tp_dp_cp_size=2)
    single_grad = _loss_only_weight_grad(single)
    dp_grad = _loss_only_weight_grad(dp_rank)
    assert dp_rank.global_tokens_per_expert.tolist() == [4, 8, 8, 4]
    logged = dp_rank.logged_losses()["global_load_balancing_loss"].item()
    assert logged == pytest.approx(
        single.logged_losses()["global_load_balancing_loss"].item() / 2, abs=FP32_LOSS_ATOL
    )
    # Each DP rank's gradient equals the single device's, so the DP average does too (issue #3672).
    torch.testing.assert_close(dp_grad, single_grad, atol=FP32_GRAD_ATOL, rtol=0)


def test_global_aux_loss_uses_the_running_mean_of_counts():
    router = _router(load_balancing=["global_aux_loss"], aux_loss_coeff=0.01)
    first, second = torch.randn(6, 4), torch.randn(6, 4)
    router(first)
    router(second)
    aux_counts = [
        torch.zeros(6, 4).scatter(1, torch.softmax(x, -1).topk(2).indices, 1.0).sum(0)
        for x in (first, second)
    ]
    mean_counts = (aux_counts[0] + aux_counts[1]) / 2
    expected_second = 4 / (2 * 36) * (torch.softmax(second, -1).sum(0) * mean_counts).sum()
    expected_first = 4 / (2 * 36) * (torch.softmax(first, -1).sum(0) * aux_counts[0]).sum()
    logged = router.logged_losses()["global_load_balancing_loss"].item()
    assert logged == pytest.approx((expected_first + expected_second).item() / 2, abs=FP32_LOSS_ATOL)
    assert router.global_aux_loss_steps.item() == 2
    router.reset_global_aux_loss_state()
    assert router.global_aux_loss_steps.item() == 0 and router.global_tokens_per_expert.sum().item() == 0


def _kept_assignment_counts(logits, capacity, padding_mask=None, **routing):
    """Oracle: per expert, the routed valid tokens among its ``capacity`` highest-probability ones.

    Dropless top-k routing of ``logits``, then, in Python, each expert keeps the routed tokens of
    highest probability (earlier token first on ties), as the ``probs`` drop policy specifies.
    """
    probs, routing_map = topk_routing(logits, 2, **routing)
    counts = []
    for expert in range(logits.shape[1]):
        routed = [t for t in range(logits.shape[0]) if routing_map[t, expert]]
        kept = sorted(routed, key=lambda t: (-probs[t, expert].item(), t))[:capacity]
        counts.append(sum(1 for t in kept if padding_mask is None or not padding_mask[t]))
    return counts


@pytest.mark.parametrize("padding_mask", [None, torch.tensor([False, True, False, False, True, False])])
def test_capacity_padding_counts_only_real_assignments_for_the_expert_bias(padding_mask):
    settings = {"score_func": "sigmoid", "expert_bias": True, "capacity_factor": 1.0}
    padded, dropping = _router(**settings, pad_to_capacity=True), _router(**settings)
    probs, routing_map = padded(REFERENCE_LOGITS, padding_mask=padding_mask)
    assert routing_map.sum(0).tolist() == [3, 3, 3, 3]  # ceil(6 * 2 / 4 * 1.0) rows per expert
    assert (probs[routing_map] > 0).sum().item() == 10  # 12 kept rows, 2 of them zero-prob fillers
    dropping(REFERENCE_LOGITS, padding_mask=padding_mask)
    expected = _kept_assignment_counts(REFERENCE_LOGITS, 3, padding_mask, score_func="sigmoid")
    # Filler rows are not load (a deliberate difference from upstream, which counts them,
    # docs/numerics.md §7): counted, every expert would hold exactly `capacity` rows and the bias
    # would never move.
    assert padded.local_tokens_per_expert.tolist() == expected
    assert dropping.local_tokens_per_expert.tolist() == expected
    assert padded.read_metric_stats()["tokens_per_expert"].tolist() == expected
    bias = padded.expert_bias
    updated = update_expert_bias(bias, padded.local_tokens_per_expert, 1e-3)
    expected_update = update_expert_bias(bias, torch.tensor(expected), 1e-3)
    torch.testing.assert_close(updated, expected_update, atol=0, rtol=0)
    assert updated.abs().sum() > 0, f"expert bias did not move: counts {expected}"


def test_force_load_balancing_routes_randomly_with_gradient_to_the_gate():
    router = _router(force_load_balancing=True)
    hidden = REFERENCE_LOGITS.clone().requires_grad_()
    main_weights = torch.randn(6, 4)
    torch.manual_seed(7)
    probs, routing_map = router(hidden)
    (probs * main_weights).sum().backward()
    torch.manual_seed(7)
    random_logits = torch.empty(6, 4).normal_().requires_grad_()
    expected_probs, expected_map = topk_routing(random_logits, 2)
    assert torch.equal(routing_map, expected_map)
    (grad_logits,) = torch.autograd.grad((expected_probs * main_weights).sum(), random_logits)
    # Straight through: the gate gets the random logits' gradient, routed through x @ W^T.
    torch.testing.assert_close(
        router.weight.grad, grad_logits.T @ REFERENCE_LOGITS, atol=FP32_GRAD_ATOL, rtol=0
    )
    assert router.weight.grad.abs().sum() > 0


def test_input_jitter_only_in_training():
    router = _router(input_jitter_eps=0.5)
    expected_eval, _ = topk_routing(REFERENCE_LOGITS, 2)
    router.eval()
    torch.testing.assert_close(router(REFERENCE_LOGITS)[0], expected_eval, atol=0, rtol=0)
    router.train()
    torch.manual_seed(3)
    jittered = router(REFERENCE_LOGITS)[0]
    torch.manual_seed(3)
    noise = torch.empty(6, 4).uniform_(0.5, 1.5)
    torch.testing.assert_close(jittered, topk_routing(REFERENCE_LOGITS * noise, 2)[0], atol=0, rtol=0)


def test_reset_parameters_is_deterministic_per_generator():
    first, second = _router(identity_weight=False), _router(identity_weight=False)
    first.reset_parameters(torch.Generator().manual_seed(11))
    second.to(torch.bfloat16).reset_parameters(torch.Generator().manual_seed(11))
    torch.testing.assert_close(second.weight.float(), first.weight.bfloat16().float(), atol=0, rtol=0)
    wide = TopKRouter(MoEConfig(hidden_size=256, ffn_hidden_size=8, num_experts=64, init_std=0.02))
    wide.reset_parameters(torch.Generator().manual_seed(0))
    assert wide.weight.std().item() == pytest.approx(0.02, rel=INIT_STD_RTOL)


def test_meta_built_router_materialises_like_an_eager_one():
    config = MoEConfig(
        hidden_size=8, ffn_hidden_size=8, num_experts=4, score_func="sigmoid", expert_bias=True
    )
    with torch.device("meta"):
        lazy = TopKRouter(config)
    lazy.to_empty(device="cpu").reset_parameters(torch.Generator().manual_seed(5))
    eager = TopKRouter(config)
    eager.reset_parameters(torch.Generator().manual_seed(5))
    torch.testing.assert_close(lazy.weight, eager.weight, atol=0, rtol=0)
    for name, buffer in lazy.named_buffers():
        assert buffer.count_nonzero() == 0, f"{name} not initialised"
    assert lazy.expert_bias.dtype == torch.float32


def test_building_a_router_on_meta_draws_nothing():
    """A strategy builds every router on the meta device and draws its weights at materialisation:
    building it must not draw (and so advance the global RNG) for a tensor it cannot hold."""
    config = MoEConfig(hidden_size=64, ffn_hidden_size=8, num_experts=16)
    before = torch.get_rng_state()
    with torch.device("meta"):
        TopKRouter(config)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(
    ("router_dtype", "input_dtype", "probs_dtype"),
    [
        ("fp64", torch.float32, torch.float64),
        (None, torch.bfloat16, torch.bfloat16),
        ("fp32", torch.bfloat16, torch.float32),
    ],
)
def test_probs_are_in_the_router_dtype(router_dtype, input_dtype, probs_dtype):
    probs, _ = _router(router_dtype=router_dtype)(REFERENCE_LOGITS.to(input_dtype))
    assert probs.dtype == probs_dtype


AUTOCAST_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
ROUTER_DTYPES = [
    pytest.param("fp32", torch.float32, id="fp32"),
    pytest.param("fp64", torch.float64, id="fp64"),
]


def _wide_router(**overrides) -> TopKRouter:
    """E=16, K=4, H=32 with a random gate: enough near-ties that half-precision logits flip top-k."""
    settings = {"hidden_size": 32, "ffn_hidden_size": 8, "num_experts": 16, "top_k": 4, **overrides}
    router = TopKRouter(MoEConfig(**settings))
    router.reset_parameters(torch.Generator().manual_seed(0))
    return router.train()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize(("router_dtype", "expected_dtype"), ROUTER_DTYPES)
@pytest.mark.parametrize("autocast_dtype", AUTOCAST_DTYPES)
def test_router_under_cpu_autocast_routes_in_the_router_dtype(
    autocast_dtype, router_dtype, expected_dtype, score_func
):
    """bf16-mixed / 16-mixed training: the gate GEMM and everything after it ignore autocast."""
    settings = {**ALL_LOSSES, "aux_loss_coeff": 0.01, "router_dtype": router_dtype, "score_func": score_func}
    reference = _wide_router(**settings)
    under_autocast = copy.deepcopy(reference)
    hidden = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))
    # Independent oracle: the logits computed in the router dtype, then dropless top-k routing.
    logits = hidden.to(expected_dtype) @ reference.weight.detach().to(expected_dtype).T
    want_probs, want_map = topk_routing(logits, 4, score_func=score_func)
    reference(hidden)
    with torch.autocast("cpu", dtype=autocast_dtype), GemmDtypes() as gemms:
        probs, routing_map = under_autocast(hidden)
    assert gemms.calls == [((expected_dtype, expected_dtype), expected_dtype)]
    assert probs.dtype == expected_dtype
    assert torch.equal(routing_map, want_map), f"{(routing_map != want_map).any(1).sum()} tokens re-routed"
    torch.testing.assert_close(probs, want_probs, atol=FP32_PROB_ATOL, rtol=0)
    want_logged, logged = reference.logged_losses(), under_autocast.logged_losses()
    assert set(logged) == set(want_logged) == set(LOGGED_LOSS_NAMES)
    for name, value in want_logged.items():
        torch.testing.assert_close(logged[name], value, atol=FP32_LOSS_ATOL, rtol=0, msg=name)


@pytest.mark.parametrize(
    "losses",
    [
        pytest.param({"z_loss_coeff": 1e-2}, id="z-loss"),
        pytest.param({"load_balancing": ["aux_loss"], "aux_loss_coeff": 0.1}, id="aux-loss"),
        pytest.param(
            {"load_balancing": ["seq_aux_loss", "global_aux_loss"], "aux_loss_coeff": 0.1}, id="seq-global"
        ),
    ],
)
@pytest.mark.parametrize("autocast_dtype", AUTOCAST_DTYPES)
def test_router_loss_gradients_unchanged_under_cpu_autocast(autocast_dtype, losses):
    reference = _wide_router(**losses)
    under_autocast = copy.deepcopy(reference)
    hidden = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    grads = []
    for router, dtype in ((reference, None), (under_autocast, autocast_dtype)):
        x = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            probs, _ = router(x, num_sequences=4)
        (probs * 0.0).sum().backward()  # only the attached losses reach the gradients
        grads.append((router.weight.grad, x.grad))
    (want_weight_grad, want_hidden_grad), (weight_grad, hidden_grad) = grads
    assert want_weight_grad.abs().sum() > 0
    assert weight_grad.dtype == torch.float32 and hidden_grad.dtype == torch.float32
    torch.testing.assert_close(weight_grad, want_weight_grad, atol=FP32_GRAD_ATOL, rtol=0)
    torch.testing.assert_close(hidden_grad, want_hidden_grad, atol=FP32_GRAD_ATOL, rtol=0)


@pytest.mark.parametrize("autocast_dtype", AUTOCAST_DTYPES)
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=["fp32-input", "bf16-input"])
def test_router_dtype_none_follows_the_input_not_autocast(input_dtype, autocast_dtype):
    """``router_dtype=None`` is the input's dtype (Megatron's meaning); autocast does not change it."""
    reference = _wide_router(router_dtype=None)
    hidden = torch.randn(256, 32, generator=torch.Generator().manual_seed(3)).to(input_dtype)
    want_probs, want_map = reference(hidden)
    with torch.autocast("cpu", dtype=autocast_dtype), GemmDtypes() as gemms:
        probs, routing_map = reference(hidden)
    assert gemms.calls == [((input_dtype, input_dtype), input_dtype)]
    assert probs.dtype == input_dtype
    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(probs, want_probs, atol=0, rtol=0)


@pytest.mark.parametrize("autocast_dtype", AUTOCAST_DTYPES)
def test_moe_layer_under_cpu_autocast_gets_router_dtype_probs(autocast_dtype):
    torch.manual_seed(0)
    config = MoEConfig(hidden_size=32, ffn_hidden_size=8, num_experts=16, top_k=4)
    layer = MoELayer(config, expert_kernel="loop")
    outputs = []
    layer.router.register_forward_hook(lambda module, args, output: outputs.append(output))
    x = torch.randn(4, 64, 32)
    layer(x)
    with torch.autocast("cpu", dtype=autocast_dtype):
        layer(x)
    (want_probs, want_map), (probs, routing_map) = outputs
    assert probs.dtype == torch.float32
    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(probs, want_probs, atol=FP32_PROB_ATOL, rtol=0)


@pytest.mark.parametrize(
    ("hidden", "kwargs", "match"),
    [
        (torch.zeros(6, 5), {}, r"expects hidden of shape \[num_tokens, 4\]"),
        (torch.zeros(2, 3, 4), {}, r"flatten \[B, S, H\] inputs"),
        (torch.zeros(6, 4), {"padding_mask": torch.zeros(6)}, "padding_mask must be a bool tensor"),
        (torch.zeros(6, 4), {"padding_mask": torch.zeros(2, 3, dtype=torch.bool)}, r"of shape \(6,\)"),
        (torch.zeros(6, 4), {"num_sequences": 4}, "num_sequences=4 must be >= 1 and divide the 6 tokens"),
    ],
)
def test_router_rejects_bad_inputs(hidden, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _router()(hidden, **kwargs)


def test_router_reduction_rejects_inconsistent_sizes():
    with pytest.raises(ValueError, match="tp_cp_size >= 1 dividing tp_dp_cp_size"):
        RouterReduction(tp_cp_size=2, tp_dp_cp_size=3)
    assert RouterReduction(tp_cp_size=2, tp_dp_cp_size=8).dp_size == 4
