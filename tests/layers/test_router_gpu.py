"""GPU checks of the router's precision under CUDA autocast (``precision="bf16-mixed"`` on a GPU).

The gate GEMM and everything after it must run in the router dtype, not in autocast's bf16, so
routing under autocast is identical to the fp32 run. CPU proxies of the same logic (CPU autocast
bf16 and fp16) are in ``test_router.py``; CUDA autocast differs from CPU autocast in also running
reductions (``sum``, ``logsumexp``, ``softplus``) in fp32, which these tests cover too.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.recorders import GemmDtypes

from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.moe import MoELayer
from lightning_moe.layers.router import LOGGED_LOSS_NAMES, TopKRouter

pytestmark = pytest.mark.gpu

# fp32 routing probabilities / losses of the same logits computed twice: a few ulps of O(1) numbers.
FP32_ATOL = 1e-6
# fp32 gradients through softmax/logsumexp and one [T]x[H] reduction over 1024 tokens.
FP32_GRAD_ATOL = 1e-5

ALL_LOSSES = {
    "load_balancing": ["aux_loss", "seq_aux_loss", "global_aux_loss"],
    "aux_loss_coeff": 0.01,
    "z_loss_coeff": 1e-3,
}
NUM_TOKENS, HIDDEN, EXPERTS, TOP_K = 1024, 256, 64, 8


def _router(**overrides) -> TopKRouter:
    """A DeepSeek-like gate (E=64, K=8) on the GPU: many near-ties, so bf16 logits flip top-k."""
    settings = {
        "hidden_size": HIDDEN, "ffn_hidden_size": 64, "num_experts": EXPERTS, "top_k": TOP_K, **overrides
    }
    router = TopKRouter(MoEConfig(**settings)).cuda()
    router.reset_parameters(torch.Generator(device="cuda").manual_seed(0))
    return router.train()


def _hidden(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(1)
    return torch.randn(NUM_TOKENS, HIDDEN, device="cuda", generator=generator).to(dtype)


def _route_with_loss_grads(router: TopKRouter, hidden: torch.Tensor, autocast: bool):
    x = hidden.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast), GemmDtypes() as gemms:
        probs, routing_map = router(x, num_sequences=4)
    (probs * 0.0).sum().backward()  # only the attached losses reach the gradients
    return probs.detach(), routing_map, gemms.calls, router.logged_losses(), router.weight.grad, x.grad


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_under_cuda_bf16_autocast_computes_fp32_logits_and_routes_like_fp32(score_func):
    reference = _router(**ALL_LOSSES, score_func=score_func)
    under_autocast = copy.deepcopy(reference)
    hidden = _hidden()
    want_probs, want_map, _, want_logged, want_weight_grad, want_hidden_grad = _route_with_loss_grads(
        reference, hidden, autocast=False
    )
    probs, routing_map, gemms, logged, weight_grad, hidden_grad = _route_with_loss_grads(
        under_autocast, hidden, autocast=True
    )
    assert gemms == [((torch.float32, torch.float32), torch.float32)]  # the gate GEMM, in fp32
    assert probs.dtype == torch.float32
    assert torch.equal(routing_map, want_map), f"{(routing_map != want_map).any(1).sum()} tokens re-routed"
    torch.testing.assert_close(probs, want_probs, atol=FP32_ATOL, rtol=0)
    assert set(logged) == set(want_logged) == set(LOGGED_LOSS_NAMES)
    for name, value in want_logged.items():
        torch.testing.assert_close(logged[name], value, atol=FP32_ATOL, rtol=0, msg=name)
    assert weight_grad.dtype == torch.float32 and bool(torch.isfinite(weight_grad).all())
    torch.testing.assert_close(weight_grad, want_weight_grad, atol=FP32_GRAD_ATOL, rtol=0)
    torch.testing.assert_close(hidden_grad, want_hidden_grad, atol=FP32_GRAD_ATOL, rtol=0)


@pytest.mark.parametrize("score_func", ["softmax", "sqrtsoftplus"])
def test_router_dtype_none_with_bf16_input_ignores_cuda_autocast(score_func):
    """``router_dtype=None`` routes bf16 activations in bf16 with or without autocast; CUDA autocast
    would otherwise run the losses' logsumexp / softplus / sums in fp32."""
    reference = _router(**ALL_LOSSES, score_func=score_func, router_dtype=None)
    under_autocast = copy.deepcopy(reference)
    hidden = _hidden(torch.bfloat16)
    want_probs, want_map, _, want_logged, want_weight_grad, _ = _route_with_loss_grads(
        reference, hidden, autocast=False
    )
    probs, routing_map, gemms, logged, weight_grad, _ = _route_with_loss_grads(
        under_autocast, hidden, autocast=True
    )
    assert gemms == [((torch.bfloat16, torch.bfloat16), torch.bfloat16)]
    assert probs.dtype == torch.bfloat16
    assert torch.equal(routing_map, want_map)
    # The same ops in the same dtype on the same device: bitwise equal.
    torch.testing.assert_close(probs, want_probs, atol=0, rtol=0)
    for name, value in want_logged.items():
        torch.testing.assert_close(logged[name], value, atol=0, rtol=0, msg=name)
    torch.testing.assert_close(weight_grad, want_weight_grad, atol=0, rtol=0)


def test_moe_layer_under_cuda_autocast_gets_fp32_router_probs():
    torch.manual_seed(0)
    config = MoEConfig(hidden_size=HIDDEN, ffn_hidden_size=64, num_experts=EXPERTS, top_k=TOP_K)
    layer = MoELayer(config, device="cuda")
    outputs = []
    layer.router.register_forward_hook(lambda module, args, output: outputs.append(output))
    x = _hidden().view(4, NUM_TOKENS // 4, HIDDEN)
    layer(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x)
    assert bool(torch.isfinite(out).all())
    (want_probs, want_map), (probs, routing_map) = outputs
    assert probs.dtype == torch.float32
    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(probs, want_probs, atol=FP32_ATOL, rtol=0)
