"""GPU checks of the expert kernels on the bf16-mixed path (run by ``benchmarks/gpu_check.sh``).

The CPU proxies of the same logic are in ``test_experts.py`` (CPU autocast with a patched bf16
policy, op recording) and ``test_sync_free.py`` (``FakeTensorMode``).
"""

from __future__ import annotations

import pytest
import torch
from helpers.asserts import assert_close_to_scale
from layers.test_experts import BF16_KERNEL_TOL, COUNTS, FP32_GRAD_TOL, HIDDEN, WEIGHT_STD, _inputs
from layers.test_experts_mixed import _double_use_inputs, _double_use_loss, _OpRecorder, _reference_grads

from lightning_moe.layers.experts import GroupedExperts

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def _experts(kernel: str, device=CUDA) -> GroupedExperts:
    experts = GroupedExperts(len(COUNTS), HIDDEN, 8, "swiglu", fc2_bias=True, kernel=kernel)
    experts.reset_parameters(layer_seed=5, std=WEIGHT_STD)
    with torch.no_grad():
        experts.fc2_bias.normal_(0.0, WEIGHT_STD, generator=torch.Generator().manual_seed(6))
    return experts.to(device)


def _step(module, x, probs, row_index, autocast: bool, grad_seed=7, permutation=False):
    x = x.detach().clone().to(CUDA).requires_grad_(True)
    probs = probs.detach().clone().to(CUDA).requires_grad_(True)
    num_out = x.shape[0] if row_index is not None else None
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = module(x, COUNTS, probs, row_index=None if row_index is None else row_index.to(CUDA),
                     num_out_rows=num_out, row_index_is_permutation=permutation)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(CUDA, out.dtype)
    out.backward(grad)
    grads = {"x": x.grad, "probs": probs.grad}
    grads.update({name: p.grad for name, p in module.named_parameters()})
    return out.detach(), grads


def _needs_sm90():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("grouped_mm's fast path needs compute capability sm90 or newer")


@pytest.mark.parametrize("fused", [False, True], ids=["rows", "row-index"])
def test_grouped_mm_under_cuda_autocast_gets_bf16_operands(fused):
    _needs_sm90()
    experts = _experts("auto")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert experts.resolved_kernel(CUDA, torch.float32) == "grouped_mm"
    tensors, row_index = _inputs("swiglu", fused=fused, seed=8)
    recorder = _OpRecorder()
    with recorder:
        out, grads = _step(experts, tensors["x"], tensors["probs"], row_index, autocast=True)
    seen = recorder.operand_dtypes(torch.ops.aten._grouped_mm.default)
    assert len(seen) >= 6 and all(d == (torch.bfloat16, torch.bfloat16) for d in seen), seen
    assert out.dtype == torch.float32
    ref_out, ref_grads = _step(_experts("loop"), tensors["x"], tensors["probs"], row_index, autocast=False)
    assert_close_to_scale(out, ref_out, BF16_KERNEL_TOL, "output")
    for name, grad in grads.items():
        assert grad.dtype == ref_grads[name].dtype, name
        assert_close_to_scale(grad, ref_grads[name], BF16_KERNEL_TOL, f"gradient of {name}")


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
def test_cuda_autocast_casts_each_weight_once_per_step(kernel):
    if kernel == "grouped_mm":
        _needs_sm90()
    experts = _experts(kernel)
    recorder = _OpRecorder()
    with recorder:
        for micro in range(3):
            tensors, row_index = _inputs("swiglu", fused=True, seed=20 + micro)
            _step(experts, tensors["x"], tensors["probs"], row_index, autocast=True, grad_seed=micro)
    for name in ("fc1_weight", "fc2_weight"):
        assert recorder.weight_casts(getattr(experts, name), torch.bfloat16) == 1, name


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
def test_permutation_scatter_uses_no_atomic_index_add_on_cuda(kernel):
    """With a permutation row index no ``index_add`` (atomics on CUDA) runs in forward or backward,
    and the result is the index_add result bit for bit, on every run."""
    if kernel == "grouped_mm":
        _needs_sm90()
    experts = _experts(kernel).to(torch.bfloat16)
    num_rows = sum(COUNTS)
    generator = torch.Generator().manual_seed(100)
    x = torch.randn(num_rows, HIDDEN, generator=generator).bfloat16()
    probs = torch.rand(num_rows, generator=generator) * 0.9 + 0.1
    row_index = torch.randperm(num_rows, generator=generator)
    experts.zero_grad(set_to_none=True)
    want_out, want_grads = _step(experts, x, probs, row_index, autocast=False)
    for _ in range(2):
        experts.zero_grad(set_to_none=True)
        recorder = _OpRecorder()
        with recorder:
            out, grads = _step(experts, x, probs, row_index, autocast=False, permutation=True)
        index_adds = {func for func, _, _ in recorder.calls if "index_add" in str(func)}
        assert not index_adds, index_adds
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], rtol=0, atol=0, msg=name)


def test_loop_kernel_used_twice_in_one_backward_on_cuda():
    experts = _experts("loop")
    inputs = [(x.to(CUDA), p.to(CUDA), i.to(CUDA)) for x, p, i in _double_use_inputs(70)]
    expected = _reference_grads(experts, [inputs])
    _double_use_loss(experts, inputs).backward()
    for name, want in expected.items():
        assert_close_to_scale(getattr(experts, name).grad, want, FP32_GRAD_TOL, f"gradient of {name}")
