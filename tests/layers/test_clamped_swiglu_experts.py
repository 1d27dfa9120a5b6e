"""GPT-OSS's MoE block in `MoELayer`: router bias, expert biases and the clamped SwiGLU.

The oracle is GPT-OSS's block written out here token by token in the checkpoint's own layout
(``gate_up_proj`` ``[E, H, 2F]`` with gate and up interleaved by column, ``down_proj`` ``[E, F, H]``,
top-k of the biased logits, softmax over the k chosen, each expert's output with its down bias
weighted by the routing weight): the layer's parameters are rearranged into that layout by hand.
The activation's hand-written backward is checked against autograd.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_moe.layers.activations import activation_backward, activation_fn, activation_with_cache
from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.moe import MoELayer
from lightning_moe.lora.grouped import LoRAGroupedExperts

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 16, 8, 4, 2, 11
OUT_TOL, GRAD_TOL = 1e-5, 1e-4


def _close(actual, expected, tol, what):
    scale = max(expected.abs().max().item(), 1e-6)
    err = (actual - expected).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} x {scale:.3g}"


# --------------------------------------------------------------------------- the activation


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("alpha, limit", [(1.702, 7.0), (1.0, 0.5)])
def test_clamped_swiglu_backward_matches_autograd(use_cache, alpha, limit):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(9, 2 * 6, generator=gen, dtype=torch.float64) * 3 * limit
    # Values exactly at the clamp bounds: torch.clamp passes their gradient; so must the backward.
    h[0, 0], h[0, 6], h[1, 6] = limit, limit, -limit
    params = {"alpha": alpha, "limit": limit}
    leaf = h.clone().requires_grad_()
    out = activation_fn("clamped_swiglu", **params)(leaf)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (expected,) = torch.autograd.grad(out, leaf, grad_out)
    # The forward's oracles are the block written out below and transformers' own GptOssMLP
    # (tests/models/test_gpt_oss_weights.py); here the published formula only pins the parameters'
    # meaning, and the backward is checked against autograd.
    gate, up = h.chunk(2, dim=-1)
    clamped = gate.clamp(max=limit)
    formula = clamped * torch.sigmoid(alpha * clamped) * (up.clamp(-limit, limit) + 1)
    torch.testing.assert_close(out.detach(), formula)
    cache = None
    if use_cache:
        value, cache = activation_with_cache("clamped_swiglu", h, **params)
        torch.testing.assert_close(value, formula)
    got = activation_backward("clamped_swiglu", h, grad_out, cache, **params)
    torch.testing.assert_close(got, expected)


def test_activation_parameters_are_checked():
    with pytest.raises(ValueError, match="takes the parameters"):
        activation_fn("clamped_swiglu", beta=1.0)
    with pytest.raises(ValueError, match="takes the parameters"):
        activation_fn("swiglu", alpha=1.0)
    with pytest.raises(ValueError, match="activation_limit"):
        MoEConfig(hidden_size=4, ffn_hidden_size=4, num_experts=2, activation="clamped_swiglu", activation_limit=0.0)


# --------------------------------------------------------------------------- the layer


def _gpt_oss_block(x, router_w, router_b, gate_up, gate_up_b, down, down_b, top_k, alpha, limit):
    """GPT-OSS's MoE block, one token and one chosen expert at a time."""
    outs = []
    for t in range(x.shape[0]):
        logits = x[t] @ router_w.t() + router_b
        top_values, top_index = torch.topk(logits, top_k)
        weights = torch.softmax(top_values, dim=-1)
        out = torch.zeros_like(x[t])
        for j in range(top_k):
            e = int(top_index[j])
            gu = x[t] @ gate_up[e] + gate_up_b[e]
            gate, up = gu[::2].clamp(max=limit), gu[1::2].clamp(min=-limit, max=limit)
            glu = gate * torch.sigmoid(gate * alpha)
            out = out + ((up + 1) * glu @ down[e] + down_b[e]) * weights[j]
        outs.append(out)
    return torch.stack(outs)


def _interleave(gate_then_up, dim):
    """``[gate ; up]`` along ``dim`` (>= 0) -> gate and up interleaved by position (the checkpoint layout)."""
    gate, up = gate_then_up.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def _gpt_oss_params(layer: MoELayer) -> dict[str, torch.Tensor]:
    """The layer's parameters in GPT-OSS's layout, as leaves for the oracle's gradients."""
    experts = layer.experts
    fc1 = experts.fc1_weight.detach()  # [E, 2F, H], gate rows then up rows
    params = {
        "router_w": layer.router.weight.detach(),
        "router_b": layer.router.bias.detach(),
        "gate_up": _interleave(fc1, dim=1).transpose(1, 2),  # [E, H, 2F] interleaved columns
        "gate_up_b": _interleave(experts.fc1_bias.detach().flatten(1), dim=1),
        "down": experts.fc2_weight.detach().transpose(1, 2),  # [E, F, H]
        "down_b": experts.fc2_bias.detach(),
    }
    return {k: v.clone().requires_grad_() for k, v in params.items()}


def _gated_config(limit: float, **overrides) -> MoEConfig:
    settings = dict(
        hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=EXPERTS, top_k=TOP_K, activation="clamped_swiglu",
        fc1_bias=True, fc2_bias=True, router_bias=True, activation_limit=limit, init_std=0.4,
    )
    settings.update(overrides)
    return MoEConfig(**settings)


def _randomise_biases(layer: MoELayer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in (layer.router.bias, layer.experts.fc1_bias, layer.experts.fc2_bias):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("limit", [7.0, 0.6])
def test_layer_matches_gpt_oss_block(kernel, recompute, limit):
    torch.manual_seed(1)
    layer = MoELayer(_gated_config(limit), expert_kernel=kernel)
    layer.experts.recompute_activation = recompute
    _randomise_biases(layer, seed=2)
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(TOKENS, HIDDEN, generator=gen) * 2).requires_grad_()
    dy = torch.randn(TOKENS, HIDDEN, generator=gen)
    ref_params = _gpt_oss_params(layer)
    x_ref = x.detach().clone().requires_grad_()

    y = layer(x)
    y.backward(dy)
    y_ref = _gpt_oss_block(x_ref, top_k=TOP_K, alpha=1.702, limit=limit, **ref_params)
    y_ref.backward(dy)

    if limit < 1:  # premise: the clamps are active on some features
        fc1_out = x.detach() @ layer.experts.fc1_weight.detach().flatten(0, 1).t()
        assert (fc1_out.abs() > limit).any()
    _close(y.detach(), y_ref.detach(), OUT_TOL, "output")
    _close(x.grad, x_ref.grad, GRAD_TOL, "input grad")
    grads = {k: v.grad for k, v in ref_params.items()}
    experts = layer.experts
    _close(layer.router.weight.grad, grads["router_w"], GRAD_TOL, "router weight grad")
    _close(layer.router.bias.grad, grads["router_b"], GRAD_TOL, "router bias grad")
    gate_up = grads["gate_up"].transpose(1, 2)  # [E, 2F, H] interleaved rows
    fc1_grad = torch.cat([gate_up[:, ::2], gate_up[:, 1::2]], dim=1)
    _close(experts.fc1_weight.grad, fc1_grad, GRAD_TOL, "fc1 weight grad")
    bias_grad = torch.stack([grads["gate_up_b"][:, ::2], grads["gate_up_b"][:, 1::2]], dim=1)
    _close(experts.fc1_bias.grad, bias_grad, GRAD_TOL, "fc1 bias grad")
    _close(experts.fc2_weight.grad, grads["down"].transpose(1, 2), GRAD_TOL, "fc2 weight grad")
    _close(experts.fc2_bias.grad, grads["down_b"], GRAD_TOL, "fc2 bias grad")


def test_state_dict_and_parameter_shapes():
    layer = MoELayer(_gated_config(7.0))
    state = layer.state_dict()
    assert state["router.bias"].shape == (EXPERTS,)
    assert state["experts.fc1_bias"].shape == (EXPERTS, 2, FFN)
    assert not layer.router.bias.any() and not layer.experts.fc1_bias.any()  # zero at init
    plain = MoELayer(_gated_config(7.0, activation="gelu"))
    assert plain.experts.fc1_bias.shape == (EXPERTS, FFN)
    # Round trip through the state dict.
    _randomise_biases(layer, seed=4)
    other = MoELayer(_gated_config(7.0))
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other.experts.fc1_bias, layer.experts.fc1_bias)


def test_lora_experts_keep_the_fc1_bias():
    torch.manual_seed(5)
    layer = MoELayer(_gated_config(0.6), expert_kernel="loop")
    _randomise_biases(layer, seed=6)
    adapted = copy.deepcopy(layer)
    LoRAGroupedExperts.convert(adapted.experts, 4, 1.0, 0.0, seed=7)  # B = 0: the same function
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        _close(adapted(x), layer(x), OUT_TOL, "LoRA output at B = 0")


def test_fp8_experts_add_the_fc1_bias():
    from lightning_moe.precision.torch_fp8 import TorchFP8Recipe
    from lightning_moe.precision.torch_fp8_convert import convert_to_float8

    torch.manual_seed(9)
    layer = MoELayer(_gated_config(2.0, init_std=0.2, ffn_hidden_size=16), expert_kernel="loop")  # FP8: multiples of 16
    _randomise_biases(layer, seed=10)
    with torch.no_grad():
        layer.experts.fc1_bias.mul_(4)  # an effect far above the FP8 rounding
    fp8 = copy.deepcopy(layer)
    assert convert_to_float8(fp8, TorchFP8Recipe()).converted == ["experts"]
    no_bias = copy.deepcopy(fp8)
    with torch.no_grad():
        no_bias.experts.fc1_bias.zero_()
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        expected, got, without = layer(x), fp8(x), no_bias(x)
    fp8_error = (got - expected).abs().max().item()
    assert fp8_error <= 0.1 * expected.abs().max().item()  # e4m3 operands: a few percent
    assert (without - expected).abs().max().item() > 5 * fp8_error  # premise: the bias matters
