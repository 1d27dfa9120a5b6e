"""Every expert kernel honours ``adds_fc2_bias`` and ``replicated_grad_sum`` (one process).

Under expert-tensor parallelism only one rank adds ``fc2_bias`` to its partial output, and the
bias's gradient is summed over the ranks where the experts use it (``lightning_moe.parallel`` sets
both; the parity against one device is tests/parallel/test_gpt_oss_expert_parallel.py). Here each
kernel (loop, grouped_mm, FP8 emulated, LoRA) is checked against plain arithmetic: the rank that
adds the bias outputs the rank that does not plus ``p * fc2_bias[expert]`` per row; the rank that
does not outputs what the same experts give with a zero bias, and its bias gradient is zero, not
None (it takes part in the gradient sum); ``replicated_grad_sum`` is applied once per forward and
its backward reaches the parameter (a stand-in doubling the gradient).
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.lora.grouped import LoRAGroupedExperts
from lightning_moe.precision import TorchFP8Recipe
from lightning_moe.precision.torch_fp8_convert import convert_to_float8

HIDDEN, FFN, EXPERTS = 16, 16, 4
COUNTS = [3, 0, 5, 2]


def _experts(variant: str) -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(
        EXPERTS, HIDDEN, FFN, activation="clamped_swiglu", activation_params={"limit": 0.8}, fc1_bias=True,
        fc2_bias=True, kernel="grouped_mm" if variant != "loop" else "loop",
    )
    experts.reset_parameters(layer_seed=1, std=0.2)
    with torch.no_grad():
        experts.fc1_bias.normal_(0, 0.5)
        experts.fc2_bias.normal_(0, 0.5)
    if variant == "fp8":
        holder = torch.nn.Module()
        holder.experts = experts
        convert_to_float8(holder, TorchFP8Recipe(), linears=False)
        experts = holder.experts
        experts.fp8_impl = "emulate"
    elif variant == "lora":
        LoRAGroupedExperts.convert(experts, rank=4, scale=2.0, dropout=0.0, seed=3)
        with torch.no_grad():
            experts.fc2_lora_B.normal_(0, 0.1)  # a non-zero adapter
        experts.fc2_bias.requires_grad_(True)  # frozen base under LoRA; trained here to see its gradient
    return experts


def _doubling_sum(calls: list) -> object:
    """A stand-in for the gradient sum over ETP: the identity whose backward doubles the gradient."""

    def grad_sum(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor)
        out = tensor.view_as(tensor)
        out.register_hook(lambda grad: grad * 2)
        return out

    return grad_sum


def _run(experts: GroupedExperts, rows: torch.Tensor, probs: torch.Tensor, dy: torch.Tensor):
    experts.zero_grad(set_to_none=True)
    out = experts(rows, list(COUNTS), probs)
    out.backward(dy)
    return out.detach(), experts.fc2_bias.grad


@pytest.mark.parametrize("variant", ["loop", "grouped_mm", "fp8", "lora"])
def test_only_the_adding_rank_adds_the_bias_and_every_rank_gets_its_gradient_summed(variant):
    gen = torch.Generator().manual_seed(5)
    n = sum(COUNTS)
    rows = torch.randn(n, HIDDEN, generator=gen)
    probs = torch.rand(n, generator=gen)
    dy = torch.randn(n, HIDDEN, generator=gen)
    expert_of_row = torch.repeat_interleave(torch.arange(EXPERTS), torch.tensor(COUNTS))

    adding, calls = _experts(variant), []
    adding.replicated_grad_sum = _doubling_sum(calls)
    out_add, grad_add = _run(adding, rows, probs, dy)
    assert len(calls) == 1

    other = copy.deepcopy(adding)
    other.adds_fc2_bias = False
    other.replicated_grad_sum = _doubling_sum(calls)
    out_other, grad_other = _run(other, rows, probs, dy)
    assert len(calls) == 2

    zero_bias = copy.deepcopy(adding)
    zero_bias.replicated_grad_sum = None
    with torch.no_grad():
        zero_bias.fc2_bias.zero_()
    out_zero, _ = _run(zero_bias, rows, probs, dy)

    bias_rows = probs.unsqueeze(-1) * adding.fc2_bias.detach()[expert_of_row]
    torch.testing.assert_close(out_other, out_zero, rtol=0, atol=0)
    torch.testing.assert_close(out_add, out_other + bias_rows, rtol=1e-5, atol=1e-5)
    # d(sum dy * p * b[e]) / db[e] = sum over e's rows of p * dy, doubled by the stand-in sum.
    expected = torch.zeros(EXPERTS, HIDDEN).index_add_(0, expert_of_row, probs.unsqueeze(-1) * dy)
    torch.testing.assert_close(grad_add, 2 * expected, rtol=1e-5, atol=1e-5)
    assert grad_other is not None and torch.equal(grad_other, torch.zeros_like(grad_other))
