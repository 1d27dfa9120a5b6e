"""Tests of the expert MLP kernels: `expert_kernels.expert_mlp` (custom autograd, optional fused
gather/scatter) against `reference_expert_mlp`, gradcheck of the hand-written backward, and the
`grouped_mm` kernel of `GroupedExperts` against the loop kernel."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.asserts import assert_close_to_scale
from layers.moe_reference import reference_activation

from lightning_moe import MoEConfig
from lightning_moe.layers import cpu_gemm
from lightning_moe.layers.activations import ACTIVATIONS, is_gated
from lightning_moe.layers.expert_kernels import expert_mlp, reference_expert_mlp
from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.layers.moe import MoELayer

ACTIVATION_NAMES = sorted(ACTIVATIONS)
# Multiples of 8 so fc1/fc2/activation rows are multiples of 16 bytes in fp32 and bf16 (CPU grouped_mm).
HIDDEN, FFN = 8, 8
COUNTS = [3, 0, 5, 0, 2]  # experts 1 and 3 receive no rows
NUM_TOKENS = 6  # tokens the fused (row_index) variant gathers from and scatters into
# Weights of std 0.5 so the activations are not in their linear region.
WEIGHT_STD = 0.5

# fp32 kernel against the fp32 autograd reference: the same GEMMs, different op order (e.g. the
# fc2 bias folded into the output in place); a few ulps, relative to the largest value compared.
FP32_OUT_TOL = 1e-5
# The hand-written backward sums in another order than autograd's (and index_add vs gather-backward).
FP32_GRAD_TOL = 1e-4
# bf16 inputs on CPU are computed in fp32 and rounded once to bf16: unit roundoff 2^-8 relative.
BF16_ROUNDING_RTOL = 2.0**-8
# grouped_mm in bf16 rounds the activation output to bf16 before fc2 (the loop kernel does not).
BF16_KERNEL_TOL = 2e-2


GEMM_BACKENDS = [
    "aten",
    pytest.param("onednn", marks=pytest.mark.skipif(
        not cpu_gemm.onednn_available(), reason="this torch build has no usable oneDNN fp32 linear")),
]


@pytest.fixture(params=GEMM_BACKENDS)
def gemm_backend(request, monkeypatch):
    """Runs the test once per CPU GEMM library. With oneDNN the small-expert cutoff is lowered to
    one row, so that these tiny experts (COUNTS 3, 5, 2) run through oneDNN, padded to 8 rows."""
    if request.param == "onednn":
        monkeypatch.setattr(cpu_gemm, "ONEDNN_MIN_ROWS", 1)
        assert [cpu_gemm.padded_row_count(n) for n in COUNTS] == [8, 0, 8, 0, 8]
    with cpu_gemm.use_cpu_gemm_backend(request.param):
        yield request.param


def _inputs(
    activation,
    counts=COUNTS,
    seed=0,
    dtype=torch.float32,
    fused=False,
    num_tokens=NUM_TOKENS,
    hidden=HIDDEN,
    ffn=FFN,
):
    """Leaf tensors ``x, fc1, fc2, fc2_bias, probs`` (and ``row_index`` when fused)."""
    generator = torch.Generator().manual_seed(seed)
    num_experts, num_rows = len(counts), sum(counts)
    fc1_rows = 2 * ffn if is_gated(activation) else ffn
    x_rows = num_tokens if fused else num_rows
    tensors = {
        "x": torch.randn(x_rows, hidden, generator=generator),
        "fc1": torch.randn(num_experts, fc1_rows, hidden, generator=generator) * WEIGHT_STD,
        "fc2": torch.randn(num_experts, hidden, ffn, generator=generator) * WEIGHT_STD,
        "fc2_bias": torch.randn(num_experts, hidden, generator=generator) * WEIGHT_STD,
        "probs": torch.rand(num_rows, generator=generator) * 0.9 + 0.1,
    }
    tensors = {
        name: (t if name == "probs" else t.to(dtype)).requires_grad_(True) for name, t in tensors.items()
    }
    row_index = None
    if fused:
        # Each expert takes a random subset of the tokens, in ascending order (the permute order).
        picks = [torch.randperm(num_tokens, generator=generator)[:n].sort().values for n in counts]
        row_index = torch.cat(picks) if picks else torch.zeros(0, dtype=torch.long)
    return tensors, row_index


def _clone_leaves(tensors, dtype=None):
    return {
        name: t.detach().to(dtype if dtype and name != "probs" else t.dtype).clone().requires_grad_(True)
        for name, t in tensors.items()
    }


def _reference(tensors, counts, activation, with_bias, row_index=None, num_tokens=NUM_TOKENS):
    """``reference_expert_mlp``, around an ``index_select``/``index_add`` when ``row_index`` is given."""
    x = tensors["x"] if row_index is None else tensors["x"].index_select(0, row_index)
    bias = tensors["fc2_bias"] if with_bias else None
    out = reference_expert_mlp(x, tensors["fc1"], tensors["fc2"], tensors["probs"], counts, activation, bias)
    if row_index is None:
        return out
    return out.new_zeros(num_tokens, out.shape[1]).index_add(0, row_index, out)


def _kernel(tensors, counts, activation, with_bias, row_index=None, save_activation=True, compute_dtype=None):
    return expert_mlp(
        tensors["x"],
        tensors["fc1"],
        tensors["fc2"],
        tensors["probs"],
        counts,
        activation=activation,
        fc2_bias=tensors["fc2_bias"] if with_bias else None,
        row_index=row_index,
        num_out_rows=NUM_TOKENS if row_index is not None else None,
        save_activation=save_activation,
        compute_dtype=compute_dtype,
    )


def _forward_backward(fn, tensors, grad_seed=1):
    out = fn(tensors)
    # Rounded to bf16 values so a bf16 kernel and its fp32 reference get the same upstream gradient.
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).bfloat16()
    out.backward(grad_out.to(out.dtype))
    return out.detach(), {name: t.grad for name, t in tensors.items()}


def _compare(kernel_result, reference_result, with_bias, out_tol=FP32_OUT_TOL, grad_tol=FP32_GRAD_TOL):
    (out, grads), (ref_out, ref_grads) = kernel_result, reference_result
    assert_close_to_scale(out, ref_out, out_tol, "output")
    for name, ref_grad in ref_grads.items():
        if name == "fc2_bias" and not with_bias:
            assert grads[name] is None
            continue
        assert grads[name] is not None, f"no gradient for {name}"
        assert_close_to_scale(grads[name], ref_grad, grad_tol, f"gradient of {name}")


@pytest.mark.parametrize("with_bias", [True, False], ids=["fc2-bias", "no-bias"])
@pytest.mark.parametrize("save_activation", [True, False], ids=["save-act", "recompute-act"])
@pytest.mark.parametrize("fused", [False, True], ids=["rows", "row-index"])
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_expert_mlp_matches_reference(activation, fused, save_activation, with_bias, gemm_backend):
    tensors, row_index = _inputs(activation, fused=fused)
    ref_tensors = _clone_leaves(tensors)
    result = _forward_backward(
        lambda t: _kernel(t, COUNTS, activation, with_bias, row_index, save_activation), tensors
    )
    reference = _forward_backward(
        lambda t: _reference(t, COUNTS, activation, with_bias, row_index), ref_tensors
    )
    _compare(result, reference, with_bias)
    if with_bias:
        # Empty experts get exactly zero weight gradients.
        for name in ("fc1", "fc2", "fc2_bias"):
            assert bool((result[1][name][[1, 3]] == 0).all()), name


def test_reference_expert_mlp_matches_the_formula():
    """The library's oracle itself: ``y = (act(x W1^T) * p) W2^T + p b2`` row by row."""
    activation = "swiglu"
    tensors, _ = _inputs(activation)
    with torch.no_grad():
        out = _reference(tensors, COUNTS, activation, with_bias=True)
        expert_of_row = torch.repeat_interleave(torch.arange(len(COUNTS)), torch.tensor(COUNTS))
        for row, expert in enumerate(expert_of_row.tolist()):
            x, p = tensors["x"][row], tensors["probs"][row]
            hidden = reference_activation(activation, tensors["fc1"][expert] @ x)
            expected = tensors["fc2"][expert] @ hidden * p + p * tensors["fc2_bias"][expert]
            assert_close_to_scale(out[row], expected, FP32_OUT_TOL, f"row {row}")


@pytest.mark.parametrize("requires", ["x", "fc1", "fc2", "fc2_bias", "probs"])
def test_expert_mlp_gradient_of_one_input_only(requires, gemm_backend):
    """The backward skips the gradients nobody asked for and still gets the requested one right."""
    tensors, row_index = _inputs("swiglu", fused=True)
    for name, t in tensors.items():
        t.requires_grad_(name == requires)
    ref_tensors = {name: t.detach().clone().requires_grad_(name == requires) for name, t in tensors.items()}
    out = _kernel(tensors, COUNTS, "swiglu", True, row_index)
    ref = _reference(ref_tensors, COUNTS, "swiglu", True, row_index)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(grad_out)
    ref.backward(grad_out)
    assert_close_to_scale(tensors[requires].grad, ref_tensors[requires].grad, FP32_GRAD_TOL, requires)
    assert all(t.grad is None for name, t in tensors.items() if name != requires)


@pytest.mark.parametrize("fused", [False, True], ids=["rows", "row-index"])
def test_expert_mlp_with_every_expert_empty(fused, gemm_backend):
    counts = [0, 0, 0]
    tensors, _ = _inputs("gelu", counts=counts, fused=fused)
    row_index = torch.zeros(0, dtype=torch.long) if fused else None
    out = _kernel(tensors, counts, "gelu", True, row_index)
    assert out.shape == ((NUM_TOKENS if fused else 0), HIDDEN)
    assert bool((out == 0).all())
    out.sum().backward()
    for name, t in tensors.items():
        assert t.grad is not None and bool((t.grad == 0).all()), name


@pytest.mark.parametrize("save_activation", [True, False], ids=["save-act", "recompute-act"])
@pytest.mark.parametrize("fused", [False, True], ids=["rows", "row-index"])
@pytest.mark.parametrize("activation", ["swiglu", "squared_relu"])
def test_expert_mlp_bf16_is_computed_in_fp32(activation, fused, save_activation):
    """bf16 x / weights (fp32 probs, the router dtype) computed in fp32 (the policy of CPUs without
    bf16 units): result in bf16, equal to the fp32 math rounded once."""
    tensors, row_index = _inputs(activation, fused=fused, dtype=torch.bfloat16)
    ref_tensors = _clone_leaves(tensors, torch.float32)  # the same values, upcast
    out, grads = _forward_backward(
        lambda t: _kernel(t, COUNTS, activation, True, row_index, save_activation, torch.float32), tensors
    )
    ref_out, ref_grads = _forward_backward(
        lambda t: _reference(t, COUNTS, activation, True, row_index), ref_tensors
    )
    assert out.dtype == torch.bfloat16
    for name, grad in grads.items():
        assert grad.dtype == tensors[name].dtype, name
    scale = ref_out.abs().max().item()
    torch.testing.assert_close(out.float(), ref_out, rtol=BF16_ROUNDING_RTOL, atol=FP32_OUT_TOL * scale)
    for name, ref_grad in ref_grads.items():
        scale = ref_grad.abs().max().item()
        torch.testing.assert_close(
            grads[name].float(),
            ref_grad,
            rtol=BF16_ROUNDING_RTOL,
            atol=FP32_GRAD_TOL * scale,
            msg=lambda message, name=name: f"gradient of {name}: {message}",
        )


@pytest.mark.parametrize("save_activation", [True, False], ids=["save-act", "recompute-act"])
@pytest.mark.parametrize("fused", [False, True], ids=["rows", "row-index"])
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_expert_mlp_gradcheck_float64(activation, fused, save_activation):
    """Finite differences of every differentiable input (x, fc1, fc2, fc2_bias, probs)."""
    counts = [2, 0, 1]
    tensors, row_index = _inputs(activation, counts=counts, fused=fused, num_tokens=3, hidden=3, ffn=2)
    inputs = tuple(t.detach().double().requires_grad_(True) for t in tensors.values())

    def fn(x, fc1, fc2, fc2_bias, probs):
        return expert_mlp(
            x,
            fc1,
            fc2,
            probs,
            counts,
            activation=activation,
            fc2_bias=fc2_bias,
            row_index=row_index,
            num_out_rows=3 if fused else None,
            save_activation=save_activation,
        )

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_expert_mlp_rejects_bad_arguments():
    tensors, row_index = _inputs("swiglu", fused=True)
    with pytest.raises(ValueError, match=re.escape("counts has 4 entries for 5 experts.")):
        expert_mlp(tensors["x"], tensors["fc1"], tensors["fc2"], tensors["probs"], COUNTS[:4])
    with pytest.raises(ValueError, match="row_index needs num_out_rows"):
        expert_mlp(
            tensors["x"], tensors["fc1"], tensors["fc2"], tensors["probs"], COUNTS, row_index=row_index
        )


# ------------------------------------------------------------------------------------------------
# GroupedExperts: grouped_mm kernel == loop kernel.


def _grouped_pair(activation, with_bias, dtype, recompute_activation=False):
    num_experts = len(COUNTS)
    loop = GroupedExperts(num_experts, HIDDEN, FFN, activation, fc2_bias=with_bias, kernel="loop")
    loop.reset_parameters(layer_seed=5, std=WEIGHT_STD)
    if with_bias:
        with torch.no_grad():
            loop.fc2_bias.normal_(0.0, WEIGHT_STD, generator=torch.Generator().manual_seed(6))
    loop.recompute_activation = recompute_activation
    grouped = GroupedExperts(num_experts, HIDDEN, FFN, activation, fc2_bias=with_bias, kernel="grouped_mm")
    grouped.load_state_dict(loop.state_dict())
    return loop.to(dtype), grouped.to(dtype)


def _run_experts(module, x, probs, row_index):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    probs = probs.detach().clone().requires_grad_(True)
    out = module(
        x, COUNTS, probs, row_index=row_index, num_out_rows=NUM_TOKENS if row_index is not None else None
    )
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    out.backward(grad_out)
    grads = {"x": x.grad, "probs": probs.grad}
    grads.update({name: p.grad for name, p in module.named_parameters()})
    return out.detach(), grads


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float32, FP32_GRAD_TOL), (torch.bfloat16, BF16_KERNEL_TOL)],
    ids=["fp32", "bf16"],
)
@pytest.mark.parametrize("fused", [False, True], ids=["rows", "row-index"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["fc2-bias", "no-bias"])
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_grouped_mm_kernel_equals_loop_kernel(activation, with_bias, fused, dtype, tol):
    loop, grouped = _grouped_pair(activation, with_bias, dtype, recompute_activation=fused)
    tensors, row_index = _inputs(activation, fused=fused, dtype=dtype, seed=8)
    loop_out, loop_grads = _run_experts(loop, tensors["x"], tensors["probs"], row_index)
    grouped_out, grouped_grads = _run_experts(grouped, tensors["x"], tensors["probs"], row_index)
    assert grouped_out.dtype == dtype
    assert_close_to_scale(grouped_out, loop_out.float(), FP32_OUT_TOL if dtype == torch.float32 else tol, "output")
    assert grouped_grads.keys() == loop_grads.keys()
    for name, grad in loop_grads.items():
        assert grouped_grads[name].dtype == grad.dtype, name
        assert_close_to_scale(grouped_grads[name], grad.float(), tol, f"gradient of {name}")
    for name in ("fc1_weight", "fc2_weight"):  # empty experts: exactly zero in both kernels
        assert bool((grouped_grads[name][[1, 3]] == 0).all()), name


def test_auto_kernel_is_loop_on_cpu_and_unknown_kernel_raises():
    experts = GroupedExperts(2, HIDDEN, FFN)
    assert experts.resolved_kernel(torch.device("cpu")) == "loop"
    assert (
        GroupedExperts(2, HIDDEN, FFN, kernel="grouped_mm").resolved_kernel(torch.device("cpu"))
        == "grouped_mm"
    )
    with pytest.raises(ValueError, match=re.escape("Unknown expert kernel 'triton'")):
        GroupedExperts(2, HIDDEN, FFN, kernel="triton")


# ----------------------------------------------------------------------------------------------
# Gradient workspace: the weight-gradient memory is reused across steps, never corrupting grads.


def _workspace_layer():
    torch.manual_seed(0)
    layer = MoELayer(_ws_config())
    x = torch.randn(2, 8, 16)
    return layer, x


def _ws_config():
    return MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)


def _fresh_grads(layer, x):
    layer.zero_grad(set_to_none=True)
    layer(x).sum().backward()
    return {n: p.grad.clone() for n, p in layer.named_parameters()}


def test_workspace_reuses_weight_gradient_memory_between_steps():
    layer, x = _workspace_layer()
    layer(x).sum().backward()
    first = layer.experts.fc1_weight.grad.data_ptr()
    layer.zero_grad(set_to_none=True)
    layer(x).sum().backward()
    assert layer.experts.fc1_weight.grad.data_ptr() == first


def test_workspace_keeps_accumulated_gradients_correct():
    layer, x = _workspace_layer()
    once = _fresh_grads(layer, x)
    layer.zero_grad(set_to_none=True)
    layer(x).sum().backward()
    layer(x).sum().backward()  # accumulates into the gradient that lives in the workspace
    for name, param in layer.named_parameters():
        torch.testing.assert_close(param.grad, 2 * once[name], rtol=1e-6, atol=1e-7, msg=name)
    layer.zero_grad(set_to_none=False)  # zeroed in place: the next backward adds to zeros
    layer(x).sum().backward()
    for name, param in layer.named_parameters():
        torch.testing.assert_close(param.grad, once[name], rtol=1e-6, atol=1e-7, msg=name)


def test_without_workspace_gradients_are_fresh_tensors():
    layer, x = _workspace_layer()
    layer.experts.grad_workspace = None
    with_ws = _workspace_layer()[0]
    torch.testing.assert_close(_fresh_grads(layer, x), _fresh_grads(with_ws, x))


def _bf16_units(monkeypatch, present: bool) -> None:
    """Pretend this CPU has (or lacks) bf16 units: the expert kernels' CPU half-precision policy."""
    from lightning_moe.layers import expert_kernels

    monkeypatch.setattr(expert_kernels, "cpu_has_bf16_units", lambda: present)



@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
@pytest.mark.parametrize("bf16_units", [True, False], ids=["bf16-units", "no-bf16-units"])
def test_moe_layer_under_cpu_autocast_matches_fp32(bf16_units, kernel, monkeypatch):
    """``precision="bf16-mixed"`` runs the layer under autocast. The router computes in fp32 (its
    logits choose the experts), both expert kernels in the CPU policy's compute dtype: bf16 where the
    CPU has bf16 units (bf16 tolerance), fp32 otherwise, where the layer then computes its fp32
    function (fp32 rounding). Outputs keep the input's dtype; no accumulation mixes dtypes."""
    _bf16_units(monkeypatch, bf16_units)
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2), expert_kernel=kernel)
    x = torch.randn(2, 8, 16, requires_grad=True)
    want = layer(x)
    want.sum().backward()
    want_grad = x.grad.clone()
    want_param_grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x)
    assert got.dtype == torch.float32
    got.sum().backward()
    tol = BF16_KERNEL_TOL if bf16_units else FP32_GRAD_TOL
    assert_close_to_scale(got, want, tol, "output")
    assert_close_to_scale(x.grad, want_grad, tol, "input gradient")
    for name, param in layer.named_parameters():
        assert param.grad.dtype == torch.float32, name
        assert_close_to_scale(param.grad, want_param_grads[name], tol, f"gradient of {name}")


@pytest.mark.parametrize("fused", [False, True], ids=["rows", "row-index"])
@pytest.mark.parametrize("activation", ["swiglu", "squared_relu"])
def test_expert_mlp_bf16_compute_matches_fp32_within_bf16_tolerance(activation, fused):
    """Computing the GEMMs in bf16 (CPUs with bf16 units, GPUs) stays within bf16 error of fp32;
    per-token sums accumulate in fp32."""
    tensors, row_index = _inputs(activation, fused=fused, dtype=torch.bfloat16)
    ref_tensors = _clone_leaves(tensors, torch.float32)
    out, grads = _forward_backward(
        lambda t: _kernel(t, COUNTS, activation, True, row_index, True, torch.bfloat16), tensors
    )
    ref_out, ref_grads = _forward_backward(lambda t: _reference(t, COUNTS, activation, True, row_index), ref_tensors)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref_out, rtol=BF16_KERNEL_TOL, atol=BF16_KERNEL_TOL * ref_out.abs().max())
    for name, ref_grad in ref_grads.items():
        torch.testing.assert_close(
            grads[name].float(), ref_grad, rtol=BF16_KERNEL_TOL, atol=BF16_KERNEL_TOL * ref_grad.abs().max(),
            msg=lambda message, name=name: f"gradient of {name}: {message}",
        )


def test_cpu_half_precision_policy_follows_the_cpu(monkeypatch):
    from lightning_moe.layers import expert_kernels

    cpu = torch.device("cpu")
    for has_units, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(expert_kernels, "cpu_has_bf16_units", lambda has_units=has_units: has_units)
        assert expert_kernels.expert_compute_dtype(torch.bfloat16, cpu) == expected
        assert expert_kernels.expert_compute_dtype(torch.float16, cpu) == torch.float32
        assert expert_kernels.expert_compute_dtype(torch.float32, cpu) == torch.float32


@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_activation_backward_matches_autograd_and_is_itself_differentiable(activation):
    """The hand-written activation gradient equals autograd's, and (for the grouped_mm kernel's
    recomputed activation) can be differentiated again: second derivatives match autograd's."""
    from lightning_moe.layers.activations import activation_backward, activation_fn, activation_with_cache

    gen = torch.Generator().manual_seed(0)
    width = 2 * FFN if is_gated(activation) else FFN
    h = torch.randn(6, width, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(6, FFN, generator=gen, dtype=torch.float64)
    expected, = torch.autograd.grad(activation_fn(activation)(h), h, grad_out, create_graph=True)
    with torch.no_grad():
        torch.testing.assert_close(activation_backward(activation, h.detach(), grad_out), expected.detach())
    got = activation_backward(activation, h, grad_out, activation_with_cache(activation, h)[1])
    torch.testing.assert_close(got, expected)

    def second_derivative(grad):  # of sum(grad^2); ReLU's gradient is piecewise constant in h
        if not grad.requires_grad:
            return torch.zeros_like(h)
        return torch.autograd.grad(grad.square().sum(), h, allow_unused=True, materialize_grads=True)[0]

    torch.testing.assert_close(second_derivative(got), second_derivative(expected))
