"""Tests of `MoELayer` against an independent dense reference (`tests/layers/moe_reference.py`).

The reference applies every expert to every token and weights it by the dense routing
probabilities, from the formulas of docs/numerics.md §2-§4 and §9, so routing, capacity,
permutation and both expert kernels of the library are checked end to end: outputs, the input
gradient and the gradient of every parameter. Load-balancing and z losses are off (they only add
router gradients and are tested in ``test_router.py``/``test_losses.py``).
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from helpers.asserts import assert_close_to_scale
from layers.moe_reference import dense_ffn, reference_moe, reference_routing

from lightning_moe.layers.activations import ACTIVATIONS
from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.dispatch import LocalDispatcher
from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.layers.moe import MoELayer

# Sizes: hidden and ffn are multiples of 8 so every row of fc1/fc2 (fp32 and bf16) is a multiple
# of 16 bytes, which torch's CPU grouped_mm requires. T = B * S = 32 tokens, E = 8 experts.
HIDDEN, FFN, NUM_EXPERTS = 16, 8, 8
BATCH, SEQ = 2, 16
NUM_TOKENS = BATCH * SEQ
SHARED_FFN = 12
# Larger than a training init (0.02) so logits are spread out (no near-ties in any top-k; the
# reference refuses those) and the activations are used outside their linear region.
INIT_STD = 0.3
EXPERT_BIAS_STD = 0.2  # comparable to the spread of sigmoid scores, so the bias changes selections
KERNELS = ("loop", "grouped_mm")

# Tolerances are relative to the largest magnitude of the reference tensor compared.
# fp32 layer against the fp32 reference: the same math with different summation orders
# (per-expert GEMMs on gathered rows vs dense GEMMs over all tokens), a few ulps per value.
FP32_OUT_TOL = 1e-5
# Gradients add reductions over tokens and experts (and through the softmax) to that error.
FP32_GRAD_TOL = 1e-4
# bf16 parameters and input against the fp32 reference on the same (upcast) values: the routed
# experts compute in fp32 and round once (2^-9 relative), but the shared expert's bf16 nn.Linear
# and the grouped_mm kernel round their intermediates to bf16 (measured: up to 5e-3).
BF16_OUT_TOL = 2e-2
# Gradients pass through more bf16 roundings (each bf16 GEMM of the backward; measured: up to 9e-3).
BF16_GRAD_TOL = 3e-2


def _config(**overrides) -> MoEConfig:
    settings = {
        "hidden_size": HIDDEN,
        "ffn_hidden_size": FFN,
        "num_experts": NUM_EXPERTS,
        "top_k": 2,
        "init_std": INIT_STD,
    }
    settings.update(overrides)
    return MoEConfig(**settings)


def _build(config: MoEConfig, kernel: str = "loop", seed: int = 0) -> MoELayer:
    """A layer with seeded weights; fc2 bias and expert bias (zero at init) set to random values."""
    torch.manual_seed(seed)
    layer = MoELayer(config, expert_kernel=kernel)
    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        if layer.experts.fc2_bias is not None:
            layer.experts.fc2_bias.normal_(0.0, INIT_STD, generator=generator)
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.normal_(0.0, EXPERT_BIAS_STD, generator=generator)
    return layer


def _randn(shape, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _run_layer(layer: MoELayer, x: torch.Tensor, grad_out: torch.Tensor, padding_mask=None):
    """Forward + backward of the layer; returns (output, input grad, {param name: grad})."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = layer(x, padding_mask)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters()}


def _run_reference(layer: MoELayer, x: torch.Tensor, grad_out: torch.Tensor):
    """The same on the fp32 reference, from the layer's own weights (upcast when bf16)."""
    params = {name: p.detach().float().clone().requires_grad_(True) for name, p in layer.named_parameters()}
    x = x.detach().float().clone().requires_grad_(True)
    out = reference_moe(params, layer.config, x, layer.router.expert_bias)
    out.backward(grad_out.float())
    return out.detach(), x.grad, {name: p.grad for name, p in params.items()}


def _check_against_reference(
    layer: MoELayer,
    x: torch.Tensor,
    padding_mask: torch.Tensor | None = None,
    out_tol: float = FP32_OUT_TOL,
    grad_tol: float = FP32_GRAD_TOL,
) -> torch.Tensor:
    """Outputs, input gradient and every parameter gradient of the layer equal the reference's."""
    # Rounded to bf16 values so a bf16 layer and the fp32 reference get the same upstream gradient.
    grad_out = _randn(x.shape, seed=99).bfloat16().float()
    out, x_grad, grads = _run_layer(layer, x, grad_out, padding_mask)
    ref_out, ref_x_grad, ref_grads = _run_reference(layer, x, grad_out)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_close_to_scale(out, ref_out, out_tol, "output")
    assert_close_to_scale(x_grad, ref_x_grad, grad_tol, "input gradient")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert grad is not None, f"{name} received no gradient"
        assert grad.dtype == dict(layer.named_parameters())[name].dtype
        assert_close_to_scale(grad, ref_grads[name], grad_tol, f"gradient of {name}")
    return out


def _reference_map(layer: MoELayer, x: torch.Tensor, expert_bias=None, config=None) -> torch.Tensor:
    """The reference's final routing map (``config`` defaults to the layer's)."""
    tokens = x.reshape(-1, HIDDEN).double()
    logits = tokens @ layer.router.weight.detach().double().T
    return reference_routing(logits, config or layer.config, expert_bias)[1]


def _spy_expert_counts(layer: MoELayer) -> list[list[int]]:
    """Record the ``tokens_per_expert`` the layer hands to its experts on every call."""
    seen: list[list[int]] = []
    forward = layer.experts.forward

    def spy(tokens, tokens_per_expert, *args, **kwargs):
        seen.append([int(c) for c in tokens_per_expert])
        return forward(tokens, tokens_per_expert, *args, **kwargs)

    layer.experts.forward = spy
    return seen


# ------------------------------------------------------------------------------------------------
# Routing variants: every score function, groups, expert bias, scaling, capacity, padding.

ROUTING_CASES = [
    pytest.param({}, id="softmax-post"),
    pytest.param({"pre_softmax": True}, id="softmax-pre"),
    pytest.param({"pre_softmax": True, "top_k": 1}, id="softmax-pre-top1"),
    pytest.param({"score_func": "sigmoid"}, id="sigmoid"),
    pytest.param({"score_func": "sigmoid", "top_k": 1}, id="sigmoid-top1"),
    pytest.param({"score_func": "sqrtsoftplus", "top_k": 3}, id="sqrtsoftplus-top3"),
    pytest.param({"score_func": "sigmoid", "topk_scaling_factor": 2.5}, id="sigmoid-scaled"),
    pytest.param({"num_groups": 4, "group_top_k": 2, "top_k": 4}, id="groups-softmax-post"),
    pytest.param({"num_groups": 4, "group_top_k": 2, "pre_softmax": True}, id="groups-softmax-pre"),
    pytest.param(
        {"score_func": "sqrtsoftplus", "num_groups": 2, "group_top_k": 1, "top_k": 3},
        id="groups-sqrtsoftplus",
    ),
    pytest.param({"score_func": "sigmoid", "expert_bias": True}, id="bias-sigmoid"),
    pytest.param(
        {"score_func": "sqrtsoftplus", "expert_bias": True, "top_k": 1}, id="bias-sqrtsoftplus-top1"
    ),
    pytest.param(
        {
            "score_func": "sigmoid",
            "expert_bias": True,
            "num_groups": 4,
            "group_top_k": 2,
            "top_k": 4,
            "topk_scaling_factor": 2.5,
        },
        id="deepseek-v3-style",
    ),
    pytest.param({"capacity_factor": 0.75}, id="capacity-probs"),
    pytest.param({"capacity_factor": 0.75, "drop_policy": "position"}, id="capacity-position"),
    pytest.param(
        {"score_func": "sigmoid", "expert_bias": True, "capacity_factor": 0.5}, id="capacity-probs-bias"
    ),
    pytest.param({"capacity_factor": 5.0}, id="capacity-above-tokens"),
    pytest.param({"capacity_factor": 1.0, "pad_to_capacity": True}, id="pad-probs"),
    pytest.param(
        {"capacity_factor": 0.5, "drop_policy": "position", "pad_to_capacity": True}, id="pad-position"
    ),
    pytest.param({"router_padding_alignment": 8}, id="router-padding"),
    pytest.param({"router_dtype": "fp64"}, id="router-fp64"),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("overrides", ROUTING_CASES)
def test_routing_variants_match_reference(overrides, kernel):
    config = _config(**overrides)
    layer = _build(config, kernel)
    x = _randn((BATCH, SEQ, HIDDEN), seed=1)
    _check_against_reference(layer, x)

    final_map = _reference_map(layer, x, layer.router.expert_bias)
    if config.capacity_factor is not None and config.capacity_factor < 1:
        # The case really drops assignments (so both policies are exercised).
        assert int(final_map.sum()) < NUM_TOKENS * config.top_k
    if config.expert_bias:
        # The bias really changes some selections (it is used, and only for selection).
        assert not torch.equal(final_map, _reference_map(layer, x, expert_bias=None))


def test_position_policy_keeps_the_earliest_tokens():
    """``position`` keeps, per expert, the first ``capacity`` routed tokens in token order."""
    config = _config(capacity_factor=0.5, drop_policy="position")
    layer = _build(config)
    x = _randn((NUM_TOKENS, HIDDEN), seed=2)
    capacity = math.ceil(NUM_TOKENS * config.top_k / NUM_EXPERTS * config.capacity_factor)
    dropless = _reference_map(layer, x, config=_config())
    with torch.no_grad():
        probs, routing_map = layer.router(x)
    for expert in range(NUM_EXPERTS):
        routed = dropless[:, expert].nonzero().flatten()
        assert routing_map[:, expert].nonzero().flatten().tolist() == routed[:capacity].tolist()
    assert bool((probs[~routing_map] == 0).all())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_pad_to_capacity_gives_every_expert_capacity_rows(policy, kernel):
    """Every expert receives exactly ``capacity`` rows; the filler rows change nothing."""
    padded = _build(_config(capacity_factor=0.75, drop_policy=policy, pad_to_capacity=True), kernel)
    unpadded = _build(_config(capacity_factor=0.75, drop_policy=policy), kernel)
    capacity = math.ceil(NUM_TOKENS * 2 / NUM_EXPERTS * 0.75)
    seen = _spy_expert_counts(padded)
    x = _randn((BATCH, SEQ, HIDDEN), seed=3)
    out = _check_against_reference(padded, x)
    assert seen == [[capacity] * NUM_EXPERTS]
    assert_close_to_scale(out, _check_against_reference(unpadded, x), FP32_OUT_TOL, "padded vs unpadded output")


@pytest.mark.parametrize("kernel", KERNELS)
def test_router_padding_alignment_gives_aligned_counts_and_same_outputs(kernel):
    alignment = 8
    aligned = _build(_config(router_padding_alignment=alignment), kernel)
    plain = _build(_config(), kernel)
    seen = _spy_expert_counts(aligned)
    x = _randn((BATCH, SEQ, HIDDEN), seed=4)
    grad_out = _randn(x.shape, seed=5)
    out, x_grad, grads = _run_layer(aligned, x, grad_out)
    plain_out, plain_x_grad, plain_grads = _run_layer(plain, x, grad_out)
    (counts,) = seen
    unaligned = _reference_map(plain, x).sum(0).tolist()
    assert all(c % alignment == 0 for c in counts), counts
    assert all(c >= u and c - u < alignment for c, u in zip(counts, unaligned)), (counts, unaligned)
    assert_close_to_scale(out, plain_out, FP32_OUT_TOL, "output")
    assert_close_to_scale(x_grad, plain_x_grad, FP32_GRAD_TOL, "input gradient")
    for name, grad in grads.items():
        assert_close_to_scale(grad, plain_grads[name], FP32_GRAD_TOL, f"gradient of {name}")


# ------------------------------------------------------------------------------------------------
# Expert variants: activations, fc2 bias, shared expert with and without gate.

EXPERT_VARIANTS = [
    pytest.param(
        {"fc2_bias": True, "shared_expert_ffn_hidden_size": SHARED_FFN, "shared_expert_gate": True},
        id="bias-shared-gated",
    ),
    pytest.param({"shared_expert_ffn_hidden_size": SHARED_FFN}, id="shared-ungated"),
    pytest.param({}, id="routed-only"),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", EXPERT_VARIANTS)
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_expert_variants_match_reference(activation, variant, kernel):
    layer = _build(_config(activation=activation, **variant), kernel)
    _check_against_reference(layer, _randn((BATCH, SEQ, HIDDEN), seed=6))


# ------------------------------------------------------------------------------------------------
# Input layouts, padding mask, bf16.


@pytest.mark.parametrize("kernel", KERNELS)
def test_flat_and_batched_layouts_agree(kernel):
    config = _config(capacity_factor=0.75, shared_expert_ffn_hidden_size=SHARED_FFN)
    layer = _build(config, kernel)
    x = _randn((BATCH, SEQ, HIDDEN), seed=7)
    batched = _check_against_reference(layer, x)
    flat = _check_against_reference(layer, x.reshape(NUM_TOKENS, HIDDEN))
    assert flat.shape == (NUM_TOKENS, HIDDEN)
    # Same tokens in the same (sequence-major) order, losses off: the same computation.
    torch.testing.assert_close(flat, batched.reshape(NUM_TOKENS, HIDDEN), rtol=0, atol=0)


@pytest.mark.parametrize("flat", [False, True], ids=["batched", "flat"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_padding_mask_keeps_padded_tokens_computed(kernel, flat):
    """Padded tokens are still routed and computed: with the losses off the mask changes nothing."""
    layer = _build(_config(score_func="sigmoid", expert_bias=True, capacity_factor=1.0), kernel)
    x = _randn((BATCH, SEQ, HIDDEN), seed=8)
    mask = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    mask[0, 10:] = True  # right padding of the first sequence
    mask[1, :3] = True  # left padding of the second
    if flat:
        x, mask = x.reshape(NUM_TOKENS, HIDDEN), mask.reshape(NUM_TOKENS)
    masked = _check_against_reference(layer, x, padding_mask=mask)
    grad_out = _randn(x.shape, seed=9)
    out, x_grad, grads = _run_layer(layer, x, grad_out)
    masked_out, masked_x_grad, masked_grads = _run_layer(layer, x, grad_out, padding_mask=mask)
    assert torch.equal(masked, out) and torch.equal(masked_out, out)
    assert torch.equal(masked_x_grad, x_grad)
    assert all(torch.equal(masked_grads[name], grad) for name, grad in grads.items())
    assert bool((out[mask].abs().sum(-1) > 0).all())


BF16_CASES = [
    pytest.param(
        {"fc2_bias": True, "shared_expert_ffn_hidden_size": SHARED_FFN, "shared_expert_gate": True},
        id="softmax-shared-gated-bias",
    ),
    pytest.param(
        {"score_func": "sigmoid", "expert_bias": True, "num_groups": 4, "group_top_k": 2, "top_k": 4},
        id="sigmoid-bias-groups",
    ),
    pytest.param({"capacity_factor": 1.0, "pad_to_capacity": True, "activation": "gelu"}, id="pad-gelu"),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("overrides", BF16_CASES)
def test_bf16_matches_fp32_reference(overrides, kernel):
    layer = _build(_config(**overrides), kernel).to(torch.bfloat16)
    assert layer.experts.fc1_weight.dtype == torch.bfloat16 and layer.router.weight.dtype == torch.bfloat16
    if layer.router.expert_bias is not None:
        assert layer.router.expert_bias.dtype == torch.float32  # kept in fp32 (upstream bug #1482)
    x = _randn((BATCH, SEQ, HIDDEN), seed=10, dtype=torch.bfloat16)
    _check_against_reference(layer, x, out_tol=BF16_OUT_TOL, grad_tol=BF16_GRAD_TOL)


# ------------------------------------------------------------------------------------------------
# Structural oracles: one expert is a dense FFN, empty experts, initialisation, state dict.


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_one_expert_top1_equals_dense_ffn(activation, kernel):
    """E=1, K=1 with pre-softmax gives every token probability 1: the layer is a dense FFN."""
    layer = _build(_config(num_experts=1, top_k=1, pre_softmax=True, activation=activation), kernel)
    fc1 = layer.experts.fc1_weight.detach()[0].clone().requires_grad_(True)
    fc2 = layer.experts.fc2_weight.detach()[0].clone().requires_grad_(True)
    x = _randn((BATCH, SEQ, HIDDEN), seed=11)
    grad_out = _randn(x.shape, seed=12)
    out, x_grad, grads = _run_layer(layer, x, grad_out)
    x_dense = x.clone().requires_grad_(True)
    dense = dense_ffn(x_dense, fc1, fc2, activation)
    dense.backward(grad_out)
    assert_close_to_scale(out, dense.detach(), FP32_OUT_TOL, "output")
    assert_close_to_scale(x_grad, x_dense.grad, FP32_GRAD_TOL, "input gradient")
    assert_close_to_scale(grads["experts.fc1_weight"][0], fc1.grad, FP32_GRAD_TOL, "fc1 gradient")
    assert_close_to_scale(grads["experts.fc2_weight"][0], fc2.grad, FP32_GRAD_TOL, "fc2 gradient")
    # softmax over one expert is constant: the router gets an exactly zero gradient.
    assert torch.equal(grads["router.weight"], torch.zeros_like(layer.router.weight))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_identical_experts_with_all_selected_equal_dense_ffn(score_func):
    """K = E with normalised probs (softmax-post, renormalised sigmoid) and identical experts."""
    layer = _build(_config(num_experts=4, top_k=4, score_func=score_func))
    with torch.no_grad():
        layer.experts.fc1_weight.copy_(layer.experts.fc1_weight[:1].expand_as(layer.experts.fc1_weight))
        layer.experts.fc2_weight.copy_(layer.experts.fc2_weight[:1].expand_as(layer.experts.fc2_weight))
    x = _randn((NUM_TOKENS, HIDDEN), seed=13)
    with torch.no_grad():
        out = layer(x)
    dense = dense_ffn(x, layer.experts.fc1_weight[0].detach(), layer.experts.fc2_weight[0].detach(), "swiglu")
    assert_close_to_scale(out, dense, FP32_OUT_TOL, "output")


@pytest.mark.parametrize("kernel", KERNELS)
def test_experts_without_tokens_get_exactly_zero_gradients(kernel):
    empty = [2, 5, 6]
    layer = _build(_config(fc2_bias=True), kernel)
    x = _randn((BATCH, SEQ, HIDDEN), seed=14)
    x[..., 0] = 3.0 + x[..., 0].abs()  # a feature that is always large and positive...
    with torch.no_grad():
        layer.router.weight[empty] = 0.0
        layer.router.weight[empty, 0] = -10.0  # ...so these experts' logits are below -30
    seen = _spy_expert_counts(layer)
    _check_against_reference(layer, x)
    (counts,) = seen
    assert [counts[e] for e in empty] == [0] * len(empty)
    assert sum(counts) == NUM_TOKENS * 2
    for name in ("experts.fc1_weight", "experts.fc2_weight", "experts.fc2_bias"):
        grad = dict(layer.named_parameters())[name].grad
        assert bool((grad[empty] == 0).all()), name
        assert bool((grad[[e for e in range(NUM_EXPERTS) if e not in empty]] != 0).any(-1).all()), name


FULL_CONFIG = {
    "score_func": "sigmoid",
    "expert_bias": True,
    "fc2_bias": True,
    "shared_expert_ffn_hidden_size": SHARED_FFN,
    "shared_expert_gate": True,
}


def _state(layer: MoELayer) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in layer.state_dict().items()}


def _assert_same_state(a: MoELayer, b: MoELayer) -> None:
    """Same state dict, and the same non-persistent buffers (counters) too."""
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert torch.equal(state_a[name].cpu(), state_b[name].cpu()), name
    buffers_a, buffers_b = dict(a.named_buffers()), dict(b.named_buffers())
    assert buffers_a.keys() == buffers_b.keys()
    for name in buffers_a:
        assert torch.equal(buffers_a[name].cpu(), buffers_b[name].cpu()), name


def test_same_seed_gives_identical_layers():
    config = _config(**FULL_CONFIG)
    torch.manual_seed(123)
    first = MoELayer(config)
    torch.manual_seed(123)
    second = MoELayer(config)
    _assert_same_state(first, second)
    torch.manual_seed(124)
    other = MoELayer(config)
    assert not torch.equal(other.experts.fc1_weight, first.experts.fc1_weight)
    assert not torch.equal(other.router.weight, first.router.weight)


@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_meta_device_build_then_reset_equals_direct_build(activation):
    config = _config(activation=activation, **FULL_CONFIG)
    torch.manual_seed(7)
    direct = MoELayer(config)
    torch.manual_seed(7)
    with torch.device("meta"):
        deferred = MoELayer(config)
    assert deferred.experts.fc1_weight.is_meta
    deferred.to_empty(device="cpu")
    deferred.reset_parameters()
    _assert_same_state(deferred, direct)
    # ...and a materialised layer computes the same function.
    x = _randn((BATCH, SEQ, HIDDEN), seed=15)
    with torch.no_grad():
        torch.testing.assert_close(deferred(x), direct(x), rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_build_and_meta_materialisation_on_cuda_equal_the_cpu_build():
    """Weights depend on (seed, index) only, not on the device (docs/architecture.md §8)."""
    config = _config(**FULL_CONFIG)
    torch.manual_seed(7)
    cpu = MoELayer(config)
    torch.manual_seed(7)
    direct = MoELayer(config, device="cuda")
    torch.manual_seed(7)
    with torch.device("meta"):
        deferred = MoELayer(config)
    deferred.to_empty(device="cuda")
    deferred.reset_parameters()
    for layer in (direct, deferred):
        assert layer.experts.fc1_weight.is_cuda and layer.shared_expert.fc1.weight.is_cuda
        _assert_same_state(layer, cpu)


@pytest.mark.parametrize("activation", ["swiglu", "squared_relu"])
def test_expert_init_is_independent_of_the_expert_parallel_layout(activation):
    """A slice of experts (EP) and a block of the ffn dimension (ETP) hold the full layer's numbers."""
    seed, std = 1234, 0.02
    full = GroupedExperts(NUM_EXPERTS, HIDDEN, FFN, activation, fc2_bias=True)
    full.reset_parameters(seed, std)
    gated = activation == "swiglu"
    for offset, count in [(0, 2), (2, 4), (7, 1)]:
        part = GroupedExperts(count, HIDDEN, FFN, activation, fc2_bias=True)
        part.expert_offset = offset
        part.reset_parameters(seed, std)
        assert torch.equal(part.fc1_weight, full.fc1_weight[offset : offset + count])
        assert torch.equal(part.fc2_weight, full.fc2_weight[offset : offset + count])
        assert torch.equal(part.fc2_bias, torch.zeros(count, HIDDEN))
    half = FFN // 2
    for rank in range(2):
        block = slice(rank * half, (rank + 1) * half)
        shard = GroupedExperts(3, HIDDEN, half, activation)
        shard.expert_offset = 4
        shard.ffn_shard = (rank, 2)
        shard.reset_parameters(seed, std)
        experts = full.fc1_weight[4:7]
        if gated:  # this rank's gate rows, then its up rows
            expected_fc1 = torch.cat([experts[:, :FFN][:, block], experts[:, FFN:][:, block]], dim=1)
        else:
            expected_fc1 = experts[:, block]
        assert torch.equal(shard.fc1_weight, expected_fc1)
        assert torch.equal(shard.fc2_weight, full.fc2_weight[4:7, :, block])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        pytest.param(
            FULL_CONFIG,
            {
                "router.weight": (NUM_EXPERTS, HIDDEN),
                "router.expert_bias": (NUM_EXPERTS,),
                "experts.fc1_weight": (NUM_EXPERTS, 2, FFN, HIDDEN),  # gated: (gate, up)
                "experts.fc2_weight": (NUM_EXPERTS, HIDDEN, FFN),
                "experts.fc2_bias": (NUM_EXPERTS, HIDDEN),
                "shared_expert.fc1.weight": (2 * SHARED_FFN, HIDDEN),
                "shared_expert.fc2.weight": (HIDDEN, SHARED_FFN),
                "shared_expert.gate.weight": (1, HIDDEN),
            },
            id="everything",
        ),
        pytest.param(
            {"activation": "gelu", "shared_expert_ffn_hidden_size": SHARED_FFN},
            {
                "router.weight": (NUM_EXPERTS, HIDDEN),
                "experts.fc1_weight": (NUM_EXPERTS, FFN, HIDDEN),
                "experts.fc2_weight": (NUM_EXPERTS, HIDDEN, FFN),
                "shared_expert.fc1.weight": (SHARED_FFN, HIDDEN),
                "shared_expert.fc2.weight": (HIDDEN, SHARED_FFN),
            },
            id="plain-activation",
        ),
        pytest.param(
            {},
            {
                "router.weight": (NUM_EXPERTS, HIDDEN),
                "experts.fc1_weight": (NUM_EXPERTS, 2, FFN, HIDDEN),  # gated: (gate, up)
                "experts.fc2_weight": (NUM_EXPERTS, HIDDEN, FFN),
            },
            id="minimal",
        ),
    ],
)
def test_state_dict_keys_and_shapes(overrides, expected):
    state = MoELayer(_config(**overrides)).state_dict()
    assert {name: tuple(t.shape) for name, t in state.items()} == expected
    if "router.expert_bias" in state:
        assert state["router.expert_bias"].dtype == torch.float32


def test_state_dict_round_trip_reproduces_the_layer():
    config = _config(**FULL_CONFIG)
    source = _build(config, seed=1)
    target = _build(config, seed=2)
    target.load_state_dict(_state(source))
    _assert_same_state(source, target)


# ------------------------------------------------------------------------------------------------
# Bad inputs.


@pytest.mark.parametrize(
    "shape", [(BATCH, SEQ, HIDDEN + 1), (NUM_TOKENS, HIDDEN - 1), (HIDDEN,), (1, BATCH, SEQ, HIDDEN)]
)
def test_wrong_hidden_shape_raises(shape):
    layer = _build(_config())
    message = re.escape(f"MoELayer expects hidden of shape [B, S, {HIDDEN}] or [T, {HIDDEN}], got {shape}.")
    with pytest.raises(ValueError, match=message):
        layer(torch.zeros(shape))


@pytest.mark.parametrize(
    ("hidden_shape", "mask_shape"),
    [
        ((BATCH, SEQ, HIDDEN), (SEQ, BATCH)),
        ((BATCH, SEQ, HIDDEN), (NUM_TOKENS,)),
        ((NUM_TOKENS, HIDDEN), (BATCH, SEQ)),
    ],
)
def test_mismatched_padding_mask_raises(hidden_shape, mask_shape):
    layer = _build(_config())
    message = re.escape(
        f"padding_mask must have shape {hidden_shape[:-1]} (hidden.shape[:-1]), got {mask_shape}."
    )
    with pytest.raises(ValueError, match=message):
        layer(torch.zeros(hidden_shape), torch.zeros(mask_shape, dtype=torch.bool))


def test_unknown_expert_kernel_raises():
    with pytest.raises(ValueError, match=re.escape("Unknown expert kernel 'cutlass'")):
        MoELayer(_config(), expert_kernel="cutlass")


@pytest.mark.parametrize("kernel", KERNELS)
def test_pad_to_capacity_at_the_largest_accepted_factor(kernel):
    """capacity_factor = E/K is accepted with padding; ceil(T*K/E * cf) may then round up to T+1."""
    config = _config(num_experts=5, top_k=3, capacity_factor=5 / 3, pad_to_capacity=True)
    assert math.ceil(7 * 3 / 5 * (5 / 3)) == 8  # float rounding: 7 tokens, capacity 8
    _check_against_reference(_build(config, kernel), _randn((7, HIDDEN), seed=16))


# ------------------------------------------------------------------------------------------------
# One layer used twice in one backward; the dispatcher's permutation flag.


@pytest.mark.parametrize("kernel", KERNELS)
def test_layer_used_twice_in_one_backward_matches_reference(kernel):
    """Two forwards of the same layer (DPO chosen/rejected, siamese losses), one backward of the sum:
    every parameter gets the sum of both uses' gradients."""
    layer = _build(_config(fc2_bias=True, shared_expert_ffn_hidden_size=SHARED_FFN), kernel)
    inputs = [_randn((BATCH, SEQ, HIDDEN), seed=s) for s in (20, 21)]
    grads_out = [_randn((BATCH, SEQ, HIDDEN), seed=s) for s in (22, 23)]
    params = {name: p.detach().clone().requires_grad_(True) for name, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    sum((layer(x) * g).sum() for x, g in zip(inputs, grads_out)).backward()
    reference = sum(
        (reference_moe(params, layer.config, x, layer.router.expert_bias) * g).sum() for x, g in zip(inputs, grads_out)
    )
    reference.backward()
    for name, param in layer.named_parameters():
        assert_close_to_scale(param.grad, params[name].grad, FP32_GRAD_TOL, f"gradient of {name}")


class _PermutationDispatcher(LocalDispatcher):
    """The local dispatcher, declaring its row index a permutation (true for top-1 dropless routing)."""

    def dispatch(self, hidden, probs, routing_map):
        rows, counts, row_probs, metadata = super().dispatch(hidden, probs, routing_map)
        return rows, counts, row_probs, _PermutationMetadata(metadata.row_index)


@dataclasses.dataclass(frozen=True)
class _PermutationMetadata:
    row_index: torch.Tensor
    row_index_is_permutation: bool = True


@pytest.mark.parametrize("kernel", KERNELS)
def test_moe_layer_passes_the_dispatchers_permutation_flag_to_the_experts(kernel):
    config = _config(top_k=1, pre_softmax=True)
    plain, flagged = _build(config, kernel), _build(config, kernel)
    flagged.dispatcher = _PermutationDispatcher(config)
    seen = []
    forward = flagged.experts.forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("row_index_is_permutation"))
        return forward(*args, **kwargs)

    flagged.experts.forward = spy
    x = _randn((BATCH, SEQ, HIDDEN), seed=24)
    grad_out = _randn(x.shape, seed=25)
    out, x_grad, grads = _run_layer(flagged, x, grad_out)
    want_out, want_x_grad, want_grads = _run_layer(plain, x, grad_out)
    assert seen == [True]
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(x_grad, want_x_grad, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=0, atol=0, msg=name)


class _HostCountExperts(GroupedExperts):
    """An expert module with its own forward of the older protocol (host counts, no permutation flag)."""

    def forward(self, tokens, tokens_per_expert, probs, row_index=None, num_out_rows=None):
        assert isinstance(tokens_per_expert, list), type(tokens_per_expert)
        return super().forward(tokens, tokens_per_expert, probs, row_index=row_index, num_out_rows=num_out_rows)


def test_expert_subclasses_with_their_own_forward_get_host_counts_and_no_permutation_flag():
    """e.g. ``Float8GroupedExperts``: the layer reads the dispatcher's device counts for them."""
    config = _config(top_k=1, pre_softmax=True)
    plain, legacy = _build(config), _build(config)
    legacy.experts.__class__ = _HostCountExperts
    legacy.dispatcher = _PermutationDispatcher(config)
    assert not _HostCountExperts.accepts_device_counts and not _HostCountExperts.accepts_permutation_flag
    x = _randn((BATCH, SEQ, HIDDEN), seed=26)
    grad_out = _randn(x.shape, seed=27)
    out, x_grad, _ = _run_layer(legacy, x, grad_out)
    want_out, want_x_grad, _ = _run_layer(plain, x, grad_out)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(x_grad, want_x_grad, rtol=0, atol=0)
