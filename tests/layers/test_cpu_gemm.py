"""Tests of the CPU GEMM backend choice (`layers.cpu_gemm`) and of the row padding it implies."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.layers import cpu_gemm
from lightning_moe.layers.cpu_gemm import AtenGemm, OneDnnGemm, gemm_for, padded_row_count, prefer_onednn
from lightning_moe.layers.expert_kernels import expert_mlp, reference_expert_mlp

needs_onednn = pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="this torch build has no usable oneDNN")


@pytest.fixture(autouse=True)
def _reset_backend(monkeypatch):
    monkeypatch.delenv(cpu_gemm.ENV_VAR, raising=False)
    yield
    cpu_gemm.set_cpu_gemm_backend(None)


def test_padded_row_count_bounds_waste_and_number_of_shapes():
    sizes = [padded_row_count(n) for n in range(1, 65537)]
    for n, m in enumerate(sizes, start=1):
        assert m >= n
        assert m - n < max(16, n / 8), (n, m)
    assert sizes == sorted(sizes)
    # Few distinct shapes however the routing moves: 8 below 128 rows, 8 per power of two above.
    assert len(set(sizes)) <= 8 + 8 * 9 + 1
    assert padded_row_count(0) == 0
    assert [padded_row_count(n) for n in (1, 16, 17, 128, 129, 256, 257)] == [16, 16, 32, 128, 144, 256, 288]


def test_auto_rule_needs_a_clear_win_for_onednn():
    assert prefer_onednn(aten_seconds=2.0, onednn_seconds=1.0)
    assert prefer_onednn(aten_seconds=1.25, onednn_seconds=1.0)
    assert not prefer_onednn(aten_seconds=1.2, onednn_seconds=1.0)
    assert not prefer_onednn(aten_seconds=1.0, onednn_seconds=2.0)


def test_backend_names_are_validated_with_the_choices_in_the_message(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown CPU GEMM backend 'mkl'.*'auto', 'aten', 'onednn'"):
        cpu_gemm.set_cpu_gemm_backend("mkl")
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "blas")
    with pytest.raises(ValueError, match=r"LIGHTNING_MOE_CPU_GEMM: unknown CPU GEMM backend 'blas'"):
        cpu_gemm.cpu_gemm_backend()


def test_forced_backend_wins_over_the_environment(monkeypatch):
    assert cpu_gemm.cpu_gemm_backend() == "auto"
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "ATEN")
    assert cpu_gemm.cpu_gemm_backend() == "aten"
    assert gemm_for(torch.device("cpu"), torch.float32, 512, 1024) is AtenGemm
    cpu_gemm.set_cpu_gemm_backend("auto")
    assert cpu_gemm.cpu_gemm_backend() == "auto"
    cpu_gemm.set_cpu_gemm_backend(None)
    assert cpu_gemm.cpu_gemm_backend() == "aten"


def test_onednn_is_only_used_for_fp32_on_cpu():
    cpu_gemm.set_cpu_gemm_backend("aten")
    for device, dtype in [("cpu", torch.float64), ("cpu", torch.bfloat16), ("cuda", torch.float32)]:
        assert gemm_for(torch.device(device), dtype, 64, 128) is AtenGemm, (device, dtype)
    if cpu_gemm.onednn_available():
        cpu_gemm.set_cpu_gemm_backend("onednn")
        assert gemm_for(torch.device("cpu"), torch.float32, 64, 128) is OneDnnGemm
        assert gemm_for(torch.device("cpu"), torch.float64, 64, 128) is AtenGemm
        assert gemm_for(torch.device("cuda"), torch.float32, 64, 128) is AtenGemm


def test_unavailable_onednn_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: False)
    with pytest.raises(ValueError, match=r"no usable oneDNN fp32 linear.*use 'aten' or 'auto'"):
        cpu_gemm.set_cpu_gemm_backend("onednn")
    cpu_gemm.set_cpu_gemm_backend("auto")
    assert gemm_for(torch.device("cpu"), torch.float32, 512, 1024) is AtenGemm


@needs_onednn
def test_onednn_gemms_equal_torch_on_strided_operands():
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(40, 96, generator=gen)
    a = big[3:23, 8:72]  # a view with an offset and a row stride wider than its rows
    w = torch.randn(48, 64, generator=gen)
    b = torch.randn(20, 48, generator=gen)
    torch.testing.assert_close(OneDnnGemm.nt(a, w), a @ w.t(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(OneDnnGemm.nn(b, w), b @ w, rtol=1e-5, atol=1e-4)
    out = torch.empty(64, 48)
    OneDnnGemm.tn_into(a, b, out)
    torch.testing.assert_close(out, a.t() @ b, rtol=1e-5, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("fused", [False, True], ids=["rows", "row-index"])
def test_padding_rows_do_not_reach_outputs_or_gradients(fused):
    """Expert 0's padding rows are expert 1's rows, a million times larger: they must not leak."""
    cpu_gemm.set_cpu_gemm_backend("onednn")
    gen = torch.Generator().manual_seed(0)
    hidden, ffn, counts = 16, 8, [3, 20, 5]
    num_tokens = sum(counts)
    x = torch.randn(num_tokens, hidden, generator=gen)
    x[3:23] *= 1e6
    fc1 = torch.randn(3, 2 * ffn, hidden, generator=gen) * 0.3
    fc2 = torch.randn(3, hidden, ffn, generator=gen) * 0.3
    probs = torch.rand(num_tokens, generator=gen)
    grad = torch.randn(num_tokens, hidden, generator=gen)
    grad[3:23] *= 1e6
    row_index = torch.arange(num_tokens) if fused else None

    def run(fn, *args):
        leaves = [t.clone().requires_grad_() for t in (x, fc1, fc2, probs)]
        out = fn(*leaves, *args)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]

    got = run(lambda *t: expert_mlp(*t, counts, row_index=row_index, num_out_rows=num_tokens))
    want = run(lambda *t: reference_expert_mlp(*t, counts))
    # Expert 0 and 2 (rows 0-2 and 23-27, weights [0] and [2]) against their own scale.
    for rows, expert in ((slice(0, 3), 0), (slice(23, 28), 2)):
        for name, g, w in (("out", got[0][rows], want[0][rows]), ("x", got[1][rows], want[1][rows]),
                           ("probs", got[4][rows], want[4][rows]), ("fc1", got[2][expert], want[2][expert]),
                           ("fc2", got[3][expert], want[3][expert])):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item(), msg=f"{name} {expert}")


def test_probes_ignore_the_callers_autocast_and_default_device():
    """The first forward may run under bf16 autocast or a meta default device: the probes must not."""
    plain = cpu_gemm.onednn_available()
    cpu_gemm.onednn_available.cache_clear()
    cpu_gemm._measured_choice.cache_clear()
    try:
        with torch.device("meta"), torch.autocast("cpu", dtype=torch.bfloat16):
            in_context = cpu_gemm.onednn_available()
            choice = cpu_gemm._measured_choice(64, 128)
    finally:
        cpu_gemm.onednn_available.cache_clear()
        cpu_gemm._measured_choice.cache_clear()
    assert in_context == plain
    assert choice in ("aten", "onednn")


def test_auto_follows_the_measurement(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: True)
    for measured, expected in (("onednn", OneDnnGemm), ("aten", AtenGemm)):
        monkeypatch.setattr(cpu_gemm, "_measured_choice", lambda i, o, m=measured: m)
        assert gemm_for(torch.device("cpu"), torch.float32, 512, 1024) is expected
