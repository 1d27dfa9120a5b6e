"""FP8 logic on the CPU: recipes, quantisation, scaled-GEMM layouts, autograd math, conversion, plugin.

``torch._scaled_mm`` runs on CPU in recent torch; where it does not, the ``scaled_mm`` fixture
replaces it by the dequantised fp32 product (feature-detected), so the autograd math is checked
either way. ``torch._scaled_grouped_mm`` is CUDA-only: its arguments are validated here by
running it on meta tensors with the exact shapes, strides and dtypes (torch's own checks), and
its values are checked against the ``emulate`` implementation on the GPU (``test_fp8_gpu.py``).

Tolerances: :data:`FP8_REL_TOL` for results of e4m3 GEMMs against an fp32 reference (e4m3 keeps 3
mantissa bits, a per-element rounding error up to 1/16; over a dot product the errors partly
cancel, measured norm-wise relative errors are 3-6%).
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_moe import MoEConfig, MoELayer, TopKRouter
from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.layers.permute import pad_routing_map
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.plugins import MoEFP8Precision
from lightning_moe.plugins import fp8 as plugin_module
from lightning_moe.precision import (
    Float8GroupedExperts,
    Float8Linear,
    TorchFP8Recipe,
    aligned_size,
    amax_reduction_group,
    apply_token_alignment,
    convert_to_float8,
    float8_grouped_linear,
    float8_linear,
    high_precision_prefixes,
    import_te,
    make_te_recipe,
    quantize,
    resolve_backend,
    scaled_mm_nt,
    te_available,
    te_fp8,
    token_alignment,
    torch_fp8_experts,
)
from lightning_moe.precision.torch_fp8 import E4M3, E5M2, check_scaled_mm_operands
from lightning_moe.precision.torch_fp8_experts import group_offsets, resolve_impl

FP8_REL_TOL = 0.08
REPO_ROOT = Path(__file__).resolve().parents[2]
needs_no_te = pytest.mark.skipif(te_available(), reason="Transformer Engine is installed here")


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().float(), expected.detach().float()
    return float((actual - expected).norm() / expected.norm())


def _cpu_scaled_mm_works() -> bool:
    try:
        one = torch.ones((), dtype=torch.float32)
        a = torch.ones(16, 16).to(E4M3)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype=None, use_fast_accum=False, **_):
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype or torch.float32)


@pytest.fixture(autouse=True)
def scaled_mm(monkeypatch):
    """``torch._scaled_mm`` on CPU, emulated by dequantised fp32 products where torch lacks it."""
    if not _cpu_scaled_mm_works():
        monkeypatch.setattr(torch, "_scaled_mm", _emulated_scaled_mm)


# ------------------------------------------------------------------------------------ recipes


def test_torch_recipe_defaults_and_validation():
    assert TorchFP8Recipe().grad_fp8_dtype == E4M3
    assert TorchFP8Recipe("tensorwise").grad_fp8_dtype == E5M2
    assert TorchFP8Recipe("tensorwise", grad_dtype="e4m3").grad_fp8_dtype == E4M3
    with pytest.raises(ValueError, match="Unknown torch FP8 scaling 'blockwise'"):
        TorchFP8Recipe("blockwise")
    with pytest.raises(ValueError, match="grad_dtype must be one of"):
        TorchFP8Recipe(grad_dtype="fp16")
    with pytest.raises(ValueError, match="grad_dtype='e5m2' is not available with rowwise scaling"):
        TorchFP8Recipe("rowwise", grad_dtype="e5m2")


# ------------------------------------------------------------------------------------ quantise


def test_quantize_rowwise_power_of_two_scales_and_saturation():
    x = torch.tensor([[1.0, -2.0, 0.5], [1000.0, 0.0, -3.0], [0.0, 0.0, 0.0]])
    q, inv = quantize(x, E4M3, dim=-1)
    assert q.dtype == E4M3 and inv.shape == (3, 1)
    scale = 1 / inv
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale), "scales are powers of two"
    assert (x.abs().amax(-1, keepdim=True) * scale <= 448).all()  # within e4m3's range
    assert (x.abs().amax(-1, keepdim=True)[:2] * scale[:2] > 224).all()  # and use its top binade
    assert torch.isfinite(q.float()).all() and torch.equal(q[2].float(), torch.zeros(3))
    torch.testing.assert_close(q.float() * inv, x, rtol=1 / 16, atol=0)


def test_quantize_tensorwise_round_trip_error():
    x = torch.randn(64, 48)
    for dtype, mantissa_bits in ((E4M3, 3), (E5M2, 2)):
        q, inv = quantize(x, dtype)
        assert inv.dim() == 0
        big = x.abs() > x.abs().max() / 64  # normal range of the scaled values
        err = ((q.float() * inv - x).abs() / x.abs())[big]
        assert err.max() <= 2.0 ** -(mantissa_bits + 1) + 1e-6


# --------------------------------------------------------------------------- scaled GEMM layouts


def test_scaled_mm_operand_rules_mirror_cuda():
    a = torch.zeros(8, 32).to(E4M3)
    b = torch.zeros(48, 32).to(E4M3).t()
    one = torch.ones((), dtype=torch.float32)
    check_scaled_mm_operands(a, b, one, one, torch.float32)
    check_scaled_mm_operands(a, b, torch.ones(8, 1), torch.ones(1, 48), torch.bfloat16)
    with pytest.raises(ValueError, match="row-major and b column-major"):
        check_scaled_mm_operands(a, b.contiguous(), one, one, torch.float32)
    with pytest.raises(ValueError, match="multiples of 16"):
        check_scaled_mm_operands(torch.zeros(8, 24).to(E4M3), torch.zeros(48, 24).to(E4M3).t(), one, one, torch.bfloat16)
    with pytest.raises(ValueError, match=r"Row-wise scales must be \(8, 1\) and \(1, 48\)"):
        check_scaled_mm_operands(a, b, torch.ones(8), torch.ones(48), torch.bfloat16)
    with pytest.raises(ValueError, match="e4m3 operands and give bf16 outputs"):
        check_scaled_mm_operands(a, b, torch.ones(8, 1), torch.ones(1, 48), torch.float32)


@pytest.mark.parametrize("rowwise", [True, False])
@pytest.mark.parametrize(("m", "k", "n"), [(32, 64, 48), (7, 40, 24)])  # aligned, and padded K / N
def test_scaled_mm_nt_equals_the_dequantised_product(rowwise, m, k, n):
    a, b = torch.randn(m, k), torch.randn(n, k)
    b_dtype = E4M3 if rowwise else E5M2  # e4m3 x e5m2 is the tensorwise gradient GEMM
    out = scaled_mm_nt(a, b, E4M3, b_dtype, rowwise=rowwise, out_dtype=torch.float32)
    dim = -1 if rowwise else None
    qa, sa = quantize(a, E4M3, dim)
    qb, sb = quantize(b, b_dtype, dim)
    expected = (qa.float() * sa) @ (qb.float() * sb).t()
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)  # bf16 output of the GEMM (rowwise)
    assert _rel(out, a @ b.t()) < FP8_REL_TOL


# ------------------------------------------------------------------------------- linear autograd


@pytest.mark.parametrize("recipe", [TorchFP8Recipe(), TorchFP8Recipe("tensorwise"), TorchFP8Recipe(wgrad_fp8=False)])
def test_float8_linear_forward_and_gradients(recipe):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 64, requires_grad=True)  # 21 tokens: the wgrad contraction is padded to 32
    weight = torch.randn(48, 64, requires_grad=True)
    bias = torch.randn(48, requires_grad=True)
    grad = torch.randn(3, 7, 48)
    out = float8_linear(x, weight, bias, recipe)
    out.backward(grad)
    x_ref, w_ref, b_ref = (t.detach().clone().requires_grad_() for t in (x, weight, bias))
    F.linear(x_ref, w_ref, b_ref).backward(grad)
    assert out.shape == (3, 7, 48)
    assert _rel(out, F.linear(x_ref, w_ref, b_ref)) < FP8_REL_TOL
    assert _rel(x.grad, x_ref.grad) < FP8_REL_TOL
    assert _rel(weight.grad, w_ref.grad) < (1e-2 if not recipe.wgrad_fp8 else FP8_REL_TOL)
    torch.testing.assert_close(bias.grad, b_ref.grad)


def test_float8_linear_follows_autocast():
    x, weight = torch.randn(16, 32), torch.randn(16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert float8_linear(x, weight, None, TorchFP8Recipe()).dtype == torch.bfloat16
    assert float8_linear(x, weight, None, TorchFP8Recipe("tensorwise")).dtype == torch.float32


# ---------------------------------------------------------------------------- grouped autograd


COUNTS = [16, 0, 5, 27]


def _grouped_reference(x, weight, counts):
    outs, start = [], 0
    for e, count in enumerate(counts):
        outs.append(x[start : start + count] @ weight[e].t())
        start += count
    return torch.cat(outs)


@pytest.mark.parametrize("wgrad_fp8", [True, False])
def test_grouped_linear_matches_the_per_expert_reference(wgrad_fp8):
    torch.manual_seed(1)
    x = torch.randn(sum(COUNTS), 32, requires_grad=True)
    weight = torch.randn(4, 48, 32, requires_grad=True)
    grad = torch.randn(sum(COUNTS), 48)
    out = float8_grouped_linear(x, weight, COUNTS, TorchFP8Recipe(wgrad_fp8=wgrad_fp8))
    out.backward(grad)
    x_ref, w_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    expected = _grouped_reference(x_ref, w_ref, COUNTS)
    expected.backward(grad)
    assert _rel(out, expected) < FP8_REL_TOL
    assert _rel(x.grad, x_ref.grad) < FP8_REL_TOL
    assert _rel(weight.grad, w_ref.grad) < FP8_REL_TOL
    assert torch.equal(weight.grad[1], torch.zeros(48, 32))  # the expert without rows


def test_loop_implementation_equals_the_emulation():
    """The per-expert ``_scaled_mm`` path and the dequantised emulation compute the same products."""
    torch.manual_seed(2)
    x = torch.randn(sum(COUNTS), 32, requires_grad=True)
    weight = torch.randn(4, 48, 32, requires_grad=True)
    results = []
    for impl in ("emulate", "loop"):
        x.grad = weight.grad = None
        out = float8_grouped_linear(x, weight, COUNTS, TorchFP8Recipe(), impl=impl)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), x.grad.clone(), weight.grad.clone()))
    for emulated, looped in zip(*results):
        torch.testing.assert_close(looped, emulated, rtol=1e-2, atol=1e-3)


def test_grouped_operands_pass_torch_scaled_grouped_mm_checks(monkeypatch):
    """Every grouped GEMM call, replayed on meta tensors through torch's own argument checks."""
    calls = []

    def on_meta(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    original_2d3d, original_2d2d = torch_fp8_experts._Impl.mm_2d3d, torch_fp8_experts._Impl.mm_2d2d

    def checked_2d3d(self, qa, qb, sa, sb, offs, counts, fast):
        out = torch._scaled_grouped_mm(on_meta(qa), on_meta(qb), on_meta(sa), on_meta(sb), offs=on_meta(offs),
                                       out_dtype=torch.bfloat16)
        calls.append(("2d3d", tuple(out.shape)))
        return original_2d3d(self, qa, qb, sa, sb, offs, counts, fast)

    def checked_2d2d(self, qa, qb, sa, sb, offs, counts):
        out = torch._scaled_grouped_mm(on_meta(qa), on_meta(qb), on_meta(sa), on_meta(sb), offs=on_meta(offs),
                                       out_dtype=torch.bfloat16)
        calls.append(("2d2d", tuple(out.shape)))
        return original_2d2d(self, qa, qb, sa, sb, offs, counts)

    monkeypatch.setattr(torch_fp8_experts._Impl, "mm_2d3d", checked_2d3d)
    monkeypatch.setattr(torch_fp8_experts._Impl, "mm_2d2d", checked_2d2d)
    counts = [16, 32, 0, 16]
    x = torch.randn(64, 32, requires_grad=True)
    weight = torch.randn(4, 48, 32, requires_grad=True)
    float8_grouped_linear(x, weight, counts, TorchFP8Recipe(), impl="emulate").sum().backward()
    assert calls == [("2d3d", (64, 48)), ("2d3d", (64, 32)), ("2d2d", (4, 48, 32))]


def test_group_offsets_and_implementation_choice():
    offs = group_offsets([8, 8, 8], torch.device("cpu"))
    assert offs.dtype == torch.int32 and offs.tolist() == [8, 16, 24]
    assert group_offsets([3, 0, 5], torch.device("cpu")).tolist() == [3, 3, 8]
    assert resolve_impl("auto", torch.device("cpu"), [16, 16], 32, 32) == "emulate"
    assert resolve_impl("loop", torch.device("cpu"), [3], 32, 32) == "loop"
    with pytest.raises(ValueError, match="Unknown FP8 grouped GEMM implementation"):
        resolve_impl("cutlass", torch.device("cpu"), [16], 16, 16)
    with pytest.raises(ValueError, match="one entry per expert"):
        float8_grouped_linear(torch.randn(10, 16), torch.randn(2, 16, 16), [5, 4], TorchFP8Recipe())


def test_per_group_column_scales_are_group_major():
    x = torch.tensor([[1.0, 2.0], [4.0, -8.0], [16.0, 0.5]])  # groups: rows {0, 1}, {2}
    offs = torch.tensor([2, 3], dtype=torch.int32)
    q, inv = torch_fp8_experts._quantize_per_group_columns(x, offs, 2, True)
    amax = torch.tensor([4.0, 8.0, 16.0, 0.5])  # [g0 c0, g0 c1, g1 c0, g1 c1]
    expected_scale = torch.exp2(torch.floor(torch.log2(448 / amax)))
    torch.testing.assert_close(inv, 1 / expected_scale)
    torch.testing.assert_close(q.float() * torch.stack([inv[:2], inv[:2], inv[2:]]), x)


# ----------------------------------------------------------------------------------- MoE experts


def _moe_config(**overrides) -> MoEConfig:
    fields = dict(hidden_size=64, ffn_hidden_size=32, num_experts=4, top_k=2, shared_expert_ffn_hidden_size=32)
    fields.update(overrides)
    return MoEConfig(**fields)


@pytest.mark.parametrize("overrides", [{}, {"fc2_bias": True}, {"router_padding_alignment": 16}])
def test_float8_experts_keep_the_state_dict_and_track_the_layer(overrides):
    torch.manual_seed(4)
    reference = MoELayer(_moe_config(**overrides))
    with torch.no_grad():
        if reference.experts.fc2_bias is not None:
            reference.experts.fc2_bias.normal_(0, 0.02)
    converted = copy.deepcopy(reference)
    report = convert_to_float8(converted, TorchFP8Recipe())
    assert isinstance(converted.experts, Float8GroupedExperts) and "experts" in report.converted
    assert isinstance(converted.shared_expert.fc1, Float8Linear)
    assert isinstance(converted.router, TopKRouter) and converted.router.weight.dtype == torch.float32
    state, state_ref = converted.state_dict(), reference.state_dict()
    assert state.keys() == state_ref.keys() and all(torch.equal(state[k], state_ref[k]) for k in state)
    hidden = torch.randn(2, 24, 64)
    outs = []
    for layer in (reference, converted):
        x = hidden.clone().requires_grad_()
        out = layer(x)
        out.backward(torch.ones_like(out))
        outs.append((out, x.grad, layer.experts.fc1_weight.grad))
    for actual, expected in zip(outs[1], outs[0]):
        assert _rel(actual, expected) < FP8_REL_TOL


# ------------------------------------------------------------------------------------ conversion


def _model(hidden: int = 64, num_layers: int = 4) -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(MoETransformerConfig(
        vocab_size=128, hidden_size=hidden, num_layers=num_layers, num_attention_heads=4, ffn_hidden_size=2 * hidden,
        moe_layer_freq=[0] + [1] * (num_layers - 1),
        moe=MoEConfig(hidden_size=hidden, ffn_hidden_size=32, num_experts=4, top_k=2,
                      shared_expert_ffn_hidden_size=32, shared_expert_gate=True),
    ))


def test_conversion_report_keeps_routers_head_gates_and_first_last_layers():
    model = _model()
    prefixes = high_precision_prefixes(model, True, 1, 1)
    assert prefixes == ("layers.0", "layers.3")
    report = convert_to_float8(model, TorchFP8Recipe(), high_precision=prefixes)
    assert report.skipped["lm_head"] == "matches skip pattern '*lm_head'"
    assert report.skipped["layers.0.attn.q_proj"].startswith("first/last layer kept in bf16")
    assert report.skipped["layers.1.ffn.shared_expert.gate"] == "features 64->1 not multiples of 16"
    assert {"layers.1.attn.q_proj", "layers.1.ffn.experts", "layers.2.ffn.shared_expert.fc2"} <= set(report.converted)
    assert not any(".router" in name for name in report.converted + list(report.skipped))
    assert type(model.layers[0].attn.q_proj) is torch.nn.Linear and type(model.layers[3].ffn.experts) is GroupedExperts
    assert isinstance(model.layers[2].ffn.experts, Float8GroupedExperts)
    tokens = torch.randint(0, 128, (2, 16))
    assert torch.isfinite(model.loss(tokens[:, :-1], tokens[:, 1:]))


def test_conversion_skips_shapes_the_gemms_cannot_take_and_refuses_dtensors():
    model = _model(hidden=24)
    report = convert_to_float8(model, TorchFP8Recipe())
    assert report.skipped["layers.1.ffn.experts"].startswith("hidden 24")
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.q_proj: tensor-parallel \(DTensor\) weights"):
        convert_to_float8(_with_fake_dtensor(), TorchFP8Recipe())


def _with_fake_dtensor() -> MoETransformer:
    model = _model()
    weight = model.layers[1].attn.q_proj.weight
    weight.placements, weight.device_mesh = ("Shard(0)",), "mesh"
    return model


def test_high_precision_prefixes_errors():
    with pytest.raises(ValueError, match=r"nn\.ModuleList named 'layers'"):
        high_precision_prefixes(torch.nn.Sequential(torch.nn.Linear(16, 16)), True)
    with pytest.raises(ValueError, match="nothing would run in FP8"):
        high_precision_prefixes(_model(num_layers=2), True, 1, 1)
    assert high_precision_prefixes(_model(), False) == ()


# ------------------------------------------------------------------------------------- alignment


def test_alignment_per_recipe_and_rounding():
    assert [token_alignment(r) for r in ("rowwise", "tensorwise", "delayed", "blockwise", "mxfp8", "nvfp4")] == [
        16, 16, 16, 16, 32, 128,
    ]
    assert [aligned_size(c, 16) for c in (0, 1, 16, 17)] == [0, 16, 16, 32]
    assert [aligned_size(c, 128) for c in (5, 128, 129)] == [128, 128, 256]
    with pytest.raises(ValueError, match="Unknown FP8 recipe"):
        token_alignment("fp6")


@pytest.mark.parametrize("alignment", [16, 32, 128])
def test_routing_map_padding_reaches_the_alignment(alignment):
    torch.manual_seed(alignment)
    num_tokens, num_experts = 1024, 4
    top = torch.randn(num_tokens, num_experts).topk(2, dim=-1).indices
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, top, True)
    padded = pad_routing_map(routing_map, alignment)
    counts, padded_counts = routing_map.sum(0).tolist(), padded.sum(0).tolist()
    assert padded_counts == [aligned_size(c, alignment) for c in counts]
    assert (padded & ~routing_map).sum() < alignment * num_experts
    assert torch.equal(padded & routing_map, routing_map)


def test_apply_token_alignment_sets_keeps_and_refuses():
    model = _model()
    assert apply_token_alignment(model, 16) == ["layers.1.ffn", "layers.2.ffn", "layers.3.ffn"]
    assert model.config.moe.router_padding_alignment == 16
    assert apply_token_alignment(model, 16) == []  # already aligned
    model.config.moe.router_padding_alignment = 48
    assert apply_token_alignment(model, 16) == []  # a multiple is fine
    with pytest.raises(ValueError, match="router_padding_alignment=48 is not a multiple of 32"):
        apply_token_alignment(model, 32)
    padded = MoELayer(_moe_config(capacity_factor=1.0, pad_to_capacity=True))
    assert apply_token_alignment(torch.nn.Sequential(padded), 16) == []
    assert padded.config.router_padding_alignment is None


# --------------------------------------------------------------------------- Transformer Engine


@needs_no_te
def test_missing_transformer_engine_names_the_extra():
    with pytest.raises(ImportError, match=r"pip install -e \"\.\[te\]\""):
        import_te()
    with pytest.raises(ImportError, match=r"pip install -e \"\.\[te\]\""):
        make_te_recipe("delayed")
    with pytest.raises(ImportError, match=r"pip install -e \"\.\[te\]\""):
        resolve_backend("te")
    with pytest.raises(ImportError, match=r"pip install -e \"\.\[te\]\""):
        MoEFP8Precision(backend="te")


def test_te_recipe_names_are_checked_before_importing_te():
    with pytest.raises(ValueError, match="Unknown Transformer Engine FP8 recipe 'rowwise'"):
        make_te_recipe("rowwise")
    with pytest.raises(ValueError, match="fp8_format must be"):
        make_te_recipe("delayed", fp8_format="e5m2")
    recipe = object()
    assert make_te_recipe(recipe) is recipe


def test_backend_resolution(monkeypatch):
    with pytest.raises(ValueError, match="Unknown FP8 backend 'fp8'"):
        resolve_backend("fp8")
    assert resolve_backend("torch") == "torch"
    monkeypatch.setattr(te_fp8, "te_available", lambda: False)
    assert resolve_backend("auto") == "torch"
    assert MoEFP8Precision().backend == "torch"
    monkeypatch.setattr(te_fp8, "te_available", lambda: True)
    assert resolve_backend("auto") == "te"


class _FakeContext:
    def __init__(self, sizes):
        self.sizes = sizes

    def size(self, name):
        return self.sizes[name]

    def group(self, name):
        return f"group:{name}"


def test_amax_reduction_group_comes_from_the_parallel_context():
    ctx = _FakeContext({"tp_dp_cp": 8, "tp_cp": 2})
    assert amax_reduction_group(ctx) == "group:tp_dp_cp"
    assert amax_reduction_group(ctx, tp_only=True) == "group:tp_cp"
    assert amax_reduction_group(_FakeContext({"tp_dp_cp": 1, "tp_cp": 1})) is None
    assert amax_reduction_group(None) is None


def test_importing_the_package_does_not_import_transformer_engine():
    code = (
        "import sys, lightning_moe, lightning_moe.precision, lightning_moe.plugins, lightning_moe.graphs\n"
        "import lightning_moe.callbacks.cuda_graphs\n"
        "from lightning_moe.plugins import MoEFP8Precision\n"
        "MoEFP8Precision(backend='torch')\n"
        "print(sorted(m for m in sys.modules if m.startswith('transformer_engine')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": ""},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------- the plugin


def test_plugin_arguments():
    plugin = MoEFP8Precision(backend="torch", recipe="tensorwise")
    assert plugin.recipe == TorchFP8Recipe("tensorwise") and plugin.precision == "bf16-mixed"
    assert MoEFP8Precision(backend="torch", weights_dtype="bfloat16").precision == "bf16-true"
    with pytest.raises(ValueError, match="not a torch-backend recipe"):
        MoEFP8Precision(backend="torch", recipe="mxfp8")
    with pytest.raises(ValueError, match="weights_dtype must be one of"):
        MoEFP8Precision(backend="torch", weights_dtype="float16")


def test_plugin_refuses_rowwise_for_te(monkeypatch):
    monkeypatch.setattr(plugin_module, "resolve_backend", lambda backend: "te")
    with pytest.raises(ValueError, match="Recipe 'rowwise' belongs to the torch backend"):
        MoEFP8Precision(backend="te", recipe="rowwise")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_torch_backend_refuses_at_convert_module_without_cuda():
    plugin = MoEFP8Precision(backend="torch")  # constructing on CPU is fine
    with pytest.raises(RuntimeError, match=r"torch FP8 backend needs a CUDA GPU.*without the FP8 plugin"):
        plugin.convert_module(_model())


def test_plugin_conversion_logic(monkeypatch):
    monkeypatch.setattr(plugin_module, "require_fp8_device", lambda recipe: None)  # pretend an H200
    plugin = MoEFP8Precision(backend="torch", first_last_bf16=True, weights_dtype="bfloat16")
    model = plugin.convert_module(_model())
    report = plugin.report
    assert "layers.1.ffn.experts" in report.converted and "layers.0.attn.q_proj" in report.skipped
    assert report.aligned_layers == ["layers.1.ffn", "layers.2.ffn", "layers.3.ffn"]
    assert model.config.moe.router_padding_alignment == 16
    assert model.layers[1].attn.q_proj.weight.dtype == torch.bfloat16
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert routers and all(r.weight.dtype == torch.float32 for r in routers)
    assert plugin.convert_input(torch.ones(2)).dtype == torch.bfloat16
    assert plugin.convert_input(torch.ones(2, dtype=torch.long)).dtype == torch.long
