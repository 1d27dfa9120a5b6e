"""Expert kernels on the mixed-precision path and in unusual graphs.

* bf16-mixed (autocast): the operand dtypes that reach the GEMMs of both kernels, the ``auto``
  kernel choice on CUDA, and the weight casts (once per optimizer step, not per micro-batch);
* one layer used twice in one backward (the gradient workspace must not hand out memory twice);
* a row index that is a pure permutation: scattered back with ``index_copy``.

Shared fixtures and tolerances come from ``test_experts.py`` (the kernels against their references).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import pytest
import torch
from helpers.asserts import assert_close_to_scale
from layers.test_experts import (
    BF16_KERNEL_TOL,
    COUNTS,
    FFN,
    FP32_GRAD_TOL,
    HIDDEN,
    NUM_TOKENS,
    _bf16_units,
    _grouped_pair,
    _inputs,
    _reference,
    _run_experts,
)
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_moe.layers.experts import GroupedExperts

# ------------------------------------------------------------------------------------------------
# bf16-mixed (autocast): the operand dtypes that reach the GEMMs, the kernel choice on CUDA, and
# the weight casts (once per optimizer step, not per micro-batch).


class _OpRecorder(TorchDispatchMode):
    """Records every aten op that runs under it (forward and backward) with its tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[object, list[torch.Tensor], dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, [a for a in args if isinstance(a, torch.Tensor)], kwargs))
        return func(*args, **kwargs)

    def operand_dtypes(self, op) -> list[tuple[torch.dtype, ...]]:
        """Dtypes of the floating-point operands of every call of ``op``."""
        return [
            tuple(t.dtype for t in tensors if t.is_floating_point())
            for func, tensors, _ in self.calls if func is op
        ]

    def weight_casts(self, weight: torch.Tensor, dtype: torch.dtype) -> int:
        """Copies of a whole tensor shaped like ``weight`` into ``dtype`` (``aten._to_copy``)."""
        return sum(
            1 for func, tensors, kwargs in self.calls
            if func is torch.ops.aten._to_copy.default and tensors[0].shape == weight.shape
            and tensors[0].dtype == weight.dtype and kwargs.get("dtype") == dtype
        )


def _autocast_step(module, x, probs, row_index, grad_seed=7, recorder=None):
    """Forward under CPU bf16 autocast, backward outside it (as Lightning's bf16-mixed does)."""
    x = x.detach().clone().requires_grad_(True)
    probs = probs.detach().clone().requires_grad_(True)
    context = recorder if recorder is not None else contextlib.nullcontext()
    with context:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(
                x, COUNTS, probs, row_index=row_index, num_out_rows=NUM_TOKENS if row_index is not None else None
            )
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
        out.backward(grad_out)
    return out.detach(), {"x": x.grad, "probs": probs.grad}


@pytest.mark.parametrize("fused", [False, True], ids=["rows", "row-index"])
@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
@pytest.mark.parametrize("bf16_units", [True, False], ids=["bf16-units", "no-bf16-units"])
def test_expert_gemm_operands_under_cpu_autocast_follow_the_compute_dtype(bf16_units, kernel, fused, monkeypatch):
    """Under bf16 autocast both kernels run their GEMMs (forward and backward) in the compute dtype
    of the CPU policy: bf16 where the CPU has bf16 units, fp32 otherwise. ``grouped_mm`` is in none
    of autocast's cast lists, so without explicit casts it would get the fp32 weights and rows."""
    _bf16_units(monkeypatch, bf16_units)
    loop, grouped = _grouped_pair("swiglu", True, torch.float32)
    module = loop if kernel == "loop" else grouped
    tensors, row_index = _inputs("swiglu", fused=fused, seed=8)
    recorder = _OpRecorder()
    module.zero_grad(set_to_none=True)
    out, grads = _autocast_step(module, tensors["x"], tensors["probs"], row_index, recorder=recorder)
    op = torch.ops.aten.mm.default if kernel == "loop" else torch.ops.aten._grouped_mm.default
    seen = recorder.operand_dtypes(op)
    expected = torch.bfloat16 if bf16_units else torch.float32
    assert len(seen) >= 6, seen  # fc1 and fc2, forward, input and weight gradients
    assert all(dtypes == (expected, expected) for dtypes in seen), seen
    # Outputs in the input's dtype; gradients reach the fp32 parameters in fp32.
    assert out.dtype == torch.float32
    for name, param in module.named_parameters():
        assert param.grad is not None and param.grad.dtype == torch.float32, name
    # The same function as the fp32 loop kernel, within the compute dtype's error.
    ref_out, ref_grads = _run_experts(_grouped_pair("swiglu", True, torch.float32)[0], tensors["x"],
                                      tensors["probs"], row_index)
    tol = BF16_KERNEL_TOL if bf16_units else FP32_GRAD_TOL
    assert_close_to_scale(out, ref_out, tol, "output")
    grads.update({name: p.grad for name, p in module.named_parameters()})
    for name, grad in grads.items():
        assert_close_to_scale(grad, ref_grads[name], tol, f"gradient of {name}")


@pytest.mark.parametrize(
    ("capability", "dtype", "expected"),
    [
        ((9, 0), torch.bfloat16, "grouped_mm"),
        ((10, 0), torch.bfloat16, "grouped_mm"),
        ((8, 0), torch.bfloat16, "loop"),  # A100: grouped_mm's per-expert fallback, with a host sync
        ((9, 0), torch.float32, "loop"),
        ((9, 0), torch.float16, "loop"),
    ],
)
def test_auto_kernel_on_cuda_is_grouped_mm_only_for_bf16_from_sm90(capability, dtype, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    experts = GroupedExperts(2, HIDDEN, FFN)
    assert experts.resolved_kernel(torch.device("cuda", 0), dtype) == expected


def _training_pair(kernel):
    """fp32 experts of ``kernel`` with an SGD optimizer, and a copy that casts on every call."""
    loop, grouped = _grouped_pair("swiglu", True, torch.float32)
    cached = loop if kernel == "loop" else grouped
    uncached = copy.deepcopy(cached)
    uncached.weight_casts = None
    return cached, uncached


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
def test_autocast_casts_each_weight_once_per_optimizer_step(kernel, monkeypatch):
    """Gradient accumulation over three micro-batches casts fc1 and fc2 to bf16 once; the in-place
    optimizer update invalidates the casts, so the next step casts (and computes) with new weights."""
    _bf16_units(monkeypatch, True)
    cached, uncached = _training_pair(kernel)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (cached, uncached)]
    for step in range(2):
        recorder = _OpRecorder()
        for micro in range(3):
            tensors, row_index = _inputs("swiglu", fused=True, seed=20 + 3 * step + micro)
            out, _ = _autocast_step(cached, tensors["x"], tensors["probs"], row_index, micro, recorder)
            want, _ = _autocast_step(uncached, tensors["x"], tensors["probs"], row_index, micro)
            # Same weights, same casts: bit-identical outputs (a stale cast would differ after step 0).
            torch.testing.assert_close(out, want, rtol=0, atol=0)
        for name in ("fc1_weight", "fc2_weight"):
            assert recorder.weight_casts(getattr(cached, name), torch.bfloat16) == 1, (step, name)
        for name, param in cached.named_parameters():
            torch.testing.assert_close(param.grad, dict(uncached.named_parameters())[name].grad, rtol=0, atol=0)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
def test_autocast_accumulated_weight_gradients_match_the_bf16_reference(kernel, monkeypatch):
    """The gradients of two cached-cast micro-batches reach the fp32 parameters: they equal the
    plain-autograd reference computed on the bf16-rounded weights, within bf16 error."""
    _bf16_units(monkeypatch, True)
    cached, _ = _training_pair(kernel)
    names = {"fc1": "fc1_weight", "fc2": "fc2_weight", "fc2_bias": "fc2_bias"}
    weights = {short: getattr(cached, long).detach().bfloat16().float().requires_grad_(True)
               for short, long in names.items()}
    for micro in range(2):
        tensors, row_index = _inputs("swiglu", fused=True, seed=40 + micro)
        _autocast_step(cached, tensors["x"], tensors["probs"], row_index, micro)
        reference = dict(weights, x=tensors["x"].detach().bfloat16().float(), probs=tensors["probs"].detach())
        out = _reference(reference, COUNTS, "swiglu", True, row_index)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(micro)))
    for short, long in names.items():
        assert_close_to_scale(getattr(cached, long).grad, weights[short].grad, BF16_KERNEL_TOL, long)


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
def test_weight_casts_are_released_when_stale_or_unused(kernel, monkeypatch):
    """One cast per weight is kept: an optimizer update replaces it (the old copy is freed once its
    graph is), and a forward that needs no cast (fp32, no autocast) drops the cache."""
    _bf16_units(monkeypatch, True)
    experts, _ = _training_pair(kernel)
    optimizer = torch.optim.SGD(experts.parameters(), lr=0.5)
    tensors, row_index = _inputs("swiglu", fused=True, seed=50)
    _autocast_step(experts, tensors["x"], tensors["probs"], row_index)
    cache = experts.weight_casts
    assert len(cache) == 2
    first = weakref.ref(cache.peek("fc1_weight"))
    assert first() is not None and first().dtype == torch.bfloat16
    optimizer.step()
    _autocast_step(experts, tensors["x"], tensors["probs"], row_index)
    gc.collect()
    assert first() is None, "the stale bf16 copy of fc1 is still alive"
    assert len(cache) == 2
    experts(tensors["x"], COUNTS, tensors["probs"], row_index=row_index, num_out_rows=NUM_TOKENS)
    assert len(cache) == 0


# ------------------------------------------------------------------------------------------------
# One layer used twice in one backward (DPO chosen/rejected, siamese losses, weight sharing).


def _loop_experts(workspace=True):
    loop, _ = _grouped_pair("swiglu", True, torch.float32)
    if not workspace:
        loop.grad_workspace = None
    return loop


def _double_use_loss(experts, inputs):
    """Sum of the experts' outputs on several inputs, each against its own upstream gradient."""
    total = 0
    for seed, (x, probs, row_index) in enumerate(inputs):
        out = experts(x, COUNTS, probs, row_index=row_index, num_out_rows=NUM_TOKENS)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(60 + seed)).to(out.device)
        total = total + (out * grad).sum()
    return total


def _reference_grads(experts, batches):
    """Plain-autograd gradients of the weights for ``batches`` (lists of inputs, one backward each)."""
    weights = {"fc1": experts.fc1_weight, "fc2": experts.fc2_weight, "fc2_bias": experts.fc2_bias}
    weights = {name: w.detach().clone().requires_grad_(True) for name, w in weights.items()}
    for inputs in batches:
        total = 0
        for seed, (x, probs, row_index) in enumerate(inputs):
            out = _reference(dict(weights, x=x, probs=probs), COUNTS, "swiglu", True, row_index)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(60 + seed)).to(out.device)
            total = total + (out * grad).sum()
        total.backward()
    return {"fc1_weight": weights["fc1"].grad, "fc2_weight": weights["fc2"].grad, "fc2_bias": weights["fc2_bias"].grad}


def _double_use_inputs(seed):
    first, row_index = _inputs("swiglu", fused=True, seed=seed)
    second, other_index = _inputs("swiglu", fused=True, seed=seed + 1)
    return [(first["x"].detach(), first["probs"].detach(), row_index),
            (second["x"].detach(), second["probs"].detach(), other_index)]


def _assert_weight_grads(experts, expected, tol=FP32_GRAD_TOL):
    for name, want in expected.items():
        assert_close_to_scale(getattr(experts, name).grad, want, tol, f"gradient of {name}")


def test_layer_used_twice_in_one_backward_gets_the_sum_of_both_gradients():
    batches = [_double_use_inputs(70)]
    expected = _reference_grads(_loop_experts(), batches)
    for workspace in (True, False):
        experts = _loop_experts(workspace)
        _double_use_loss(experts, batches[0]).backward()
        _assert_weight_grads(experts, expected)


def test_layer_used_twice_with_gradient_accumulation_and_zeroed_grads():
    """Two double-use backward calls accumulate; after ``zero_grad(set_to_none=False)`` (the
    gradient zeroed in place, still in the workspace's memory) the next one starts from zero."""
    batches = [_double_use_inputs(80), _double_use_inputs(82)]
    experts = _loop_experts()
    for inputs in batches:
        _double_use_loss(experts, inputs).backward()
    _assert_weight_grads(experts, _reference_grads(experts, batches))
    experts.zero_grad(set_to_none=False)
    _double_use_loss(experts, batches[1]).backward()
    _assert_weight_grads(experts, _reference_grads(experts, batches[1:]))
    experts.zero_grad(set_to_none=True)
    _double_use_loss(experts, batches[0]).backward()
    _assert_weight_grads(experts, _reference_grads(experts, batches[:1]))


def test_existing_gradient_view_into_a_bucket_is_accumulated_into():
    """A ``param.grad`` that is a view into a persistent bucket (gradient sync) is added to in place,
    never overwritten or replaced, also when the layer is used twice in the backward."""
    experts = _loop_experts()
    params = [experts.fc1_weight, experts.fc2_weight, experts.fc2_bias]
    bucket = torch.randn(sum(p.numel() for p in params), generator=torch.Generator().manual_seed(90))
    initial = bucket.clone()
    offset = 0
    for param in params:
        param.grad = bucket[offset:offset + param.numel()].view(param.shape)
        offset += param.numel()
    batches = [_double_use_inputs(92)]
    expected = _reference_grads(experts, batches)
    for _ in range(2):  # the second backward: the workspace's memory is free again
        _double_use_loss(experts, batches[0]).backward()
    offset = 0
    for param, name in zip(params, ("fc1_weight", "fc2_weight", "fc2_bias")):
        assert param.grad.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr(), name
        want = initial[offset:offset + param.numel()].view(param.shape) + 2 * expected[name]
        assert_close_to_scale(param.grad, want, FP32_GRAD_TOL, name)
        offset += param.numel()


# ------------------------------------------------------------------------------------------------
# A row index that is a pure permutation (the all-to-all dispatcher's received rows): scattered
# back with index_copy (deterministic on every device) instead of an atomic index_add.


@pytest.mark.parametrize("with_bias", [True, False], ids=["fc2-bias", "no-bias"])
@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
def test_permutation_row_index_scatters_with_index_copy(kernel, with_bias):
    num_rows = sum(COUNTS)
    pair = _grouped_pair("swiglu", with_bias, torch.float32, recompute_activation=True)
    module = pair[0] if kernel == "loop" else pair[1]
    generator = torch.Generator().manual_seed(100)
    x = torch.randn(num_rows, HIDDEN, generator=generator)
    probs = torch.rand(num_rows, generator=generator) * 0.9 + 0.1
    row_index = torch.randperm(num_rows, generator=generator)
    grad_out = torch.randn(num_rows, HIDDEN, generator=generator)
    results = []
    for permutation in (False, True):
        module.zero_grad(set_to_none=True)
        leaves = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        recorder = _OpRecorder()
        with recorder:
            out = module(leaves[0], COUNTS, leaves[1], row_index=row_index, num_out_rows=num_rows,
                         row_index_is_permutation=permutation)
            out.backward(grad_out)
        ops = {func for func, _, _ in recorder.calls}
        index_adds = {op for op in ops if "index_add" in str(op)}
        if permutation:
            assert not index_adds, index_adds
            assert any("index_copy" in str(op) for op in ops)
        else:
            assert index_adds
        grads = [t.grad for t in leaves] + [p.grad for p in module.parameters()]
        results.append((out.detach(), grads))
    # Each row is written once either way: exactly the index_add result.
    (add_out, add_grads), (copy_out, copy_grads) = results
    torch.testing.assert_close(copy_out, add_out, rtol=0, atol=0)
    for got, want in zip(copy_grads, add_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
def test_permutation_flag_needs_one_row_per_output_row(kernel):
    experts = _grouped_pair("swiglu", True, torch.float32)[0 if kernel == "loop" else 1]
    tensors, row_index = _inputs("swiglu", fused=True)
    with pytest.raises(ValueError, match="row_index_is_permutation=True needs"):
        experts(tensors["x"], COUNTS, tensors["probs"], row_index=row_index, num_out_rows=NUM_TOKENS,
                row_index_is_permutation=True)
