"""Tests of `lightning_moe.layers.shared_expert.SharedExpertMLP` against hand-written formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.layers.activations import ACTIVATIONS
from lightning_moe.layers.shared_expert import SharedExpertMLP

# fp32 matmuls of width <= 16 computed by nn.Linear and by explicit `@` may use different kernels
# and summation orders: differences of a few ulps, far below 1e-5.
FP32_OUTPUT_ATOL = 1e-5
# Gradients add one more reduction (over the batch) to the output error.
FP32_GRAD_ATOL = 1e-4
HIDDEN, FFN = 8, 12
INIT_STD = 0.02


def _reference_forward(module: SharedExpertMLP, x: torch.Tensor) -> torch.Tensor:
    """The formula written out from the raw weights, independent of the module's code."""
    w1, w2 = module.fc1.weight, module.fc2.weight
    if module.activation == "swiglu":
        w_gate, w_up = w1[:FFN], w1[FFN:]  # public layout: gate rows first, then up rows
        hidden = F.silu(x @ w_gate.T) * (x @ w_up.T)
    elif module.activation == "clamped_swiglu":  # GPT-OSS's, alpha 1.702 and limit 7.0
        gate = (x @ w1[:FFN].T).clamp(max=7.0)
        hidden = gate * torch.sigmoid(1.702 * gate) * ((x @ w1[FFN:].T).clamp(-7.0, 7.0) + 1)
    elif module.activation == "gelu":
        hidden = F.gelu(x @ w1.T)
    elif module.activation == "relu":
        hidden = torch.relu(x @ w1.T)
    elif module.activation == "squared_relu":
        hidden = torch.relu(x @ w1.T) ** 2
    else:
        raise AssertionError(f"test has no reference for {module.activation!r}")
    output = hidden @ w2.T
    if module.gate is not None:
        output = output * torch.sigmoid(x @ module.gate.weight.T)
    return output


def _module(activation: str, gate: bool, seed: int = 0) -> SharedExpertMLP:
    module = SharedExpertMLP(HIDDEN, FFN, activation=activation, gate=gate)
    # Larger std than training so the activations are not all in their linear region.
    module.reset_parameters(torch.Generator().manual_seed(seed), std=0.5)
    return module


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_forward_and_grads_match_reference(activation, gate):
    module = _module(activation, gate)
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(1), requires_grad=True)
    upstream_grad = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(2))

    output = module(x)
    assert output.shape == x.shape
    (output * upstream_grad).sum().backward()
    module_grads = [p.grad.clone() for p in module.parameters()]
    x_grad = x.grad.clone()
    module.zero_grad()
    x.grad = None

    expected = _reference_forward(module, x)
    (expected * upstream_grad).sum().backward()

    torch.testing.assert_close(output, expected, atol=FP32_OUTPUT_ATOL, rtol=0)
    torch.testing.assert_close(x.grad, x_grad, atol=FP32_GRAD_ATOL, rtol=0)
    for got, want in zip(module_grads, (p.grad for p in module.parameters())):
        torch.testing.assert_close(got, want, atol=FP32_GRAD_ATOL, rtol=0)


@pytest.mark.parametrize(
    ("activation", "gate", "expected"),
    [
        (
            "swiglu",
            True,
            {"fc1.weight": (2 * FFN, HIDDEN), "fc2.weight": (HIDDEN, FFN), "gate.weight": (1, HIDDEN)},
        ),
        ("swiglu", False, {"fc1.weight": (2 * FFN, HIDDEN), "fc2.weight": (HIDDEN, FFN)}),
        (
            "gelu",
            True,
            {"fc1.weight": (FFN, HIDDEN), "fc2.weight": (HIDDEN, FFN), "gate.weight": (1, HIDDEN)},
        ),
        ("relu", False, {"fc1.weight": (FFN, HIDDEN), "fc2.weight": (HIDDEN, FFN)}),
    ],
)
def test_state_dict_is_the_public_format(activation, gate, expected):
    state = SharedExpertMLP(HIDDEN, FFN, activation=activation, gate=gate).state_dict()
    assert {key: tuple(value.shape) for key, value in state.items()} == expected


def test_reset_parameters_is_deterministic_per_generator():
    first = SharedExpertMLP(HIDDEN, FFN, gate=True)
    second = SharedExpertMLP(HIDDEN, FFN, gate=True)
    torch.manual_seed(123)  # the global RNG must not matter
    first.reset_parameters(torch.Generator().manual_seed(7), std=INIT_STD)
    torch.manual_seed(456)
    second.reset_parameters(torch.Generator().manual_seed(7), std=INIT_STD)
    for key, value in first.state_dict().items():
        torch.testing.assert_close(value, second.state_dict()[key], atol=0, rtol=0)

    second.reset_parameters(torch.Generator().manual_seed(8), std=INIT_STD)
    assert not torch.equal(first.fc1.weight, second.fc1.weight)


def test_reset_parameters_draws_with_the_given_std():
    module = SharedExpertMLP(256, 512)
    module.reset_parameters(torch.Generator().manual_seed(0), std=INIT_STD)
    # 262144 fc1 samples: the sample std is within 1% of INIT_STD with overwhelming probability.
    assert abs(module.fc1.weight.std().item() - INIT_STD) < 0.01 * INIT_STD
    assert abs(module.fc1.weight.mean().item()) < 0.01 * INIT_STD


def test_invalid_arguments_raise():
    with pytest.raises(ValueError, match="Unknown activation 'tanh'"):
        SharedExpertMLP(HIDDEN, FFN, activation="tanh")
    with pytest.raises(ValueError, match="ffn_hidden_size >= 1"):
        SharedExpertMLP(HIDDEN, 0)
