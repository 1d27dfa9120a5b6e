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
    small = cpu_gemm.ONEDNN_MIN_ROWS
    sizes = {n: padded_row_count(n) for n in range(0, 65537)}
    for n, m in sizes.items():
        if n < small:
            assert m == n  # run through torch.mm, unpadded
        else:
            assert m >= n and m % 8 == 0 and m - n <= max(7, n / 8), (n, m)
    assert list(sizes.values()) == sorted(sizes.values())
    # Few distinct shapes for oneDNN however the routing moves: 7 + 8 below 128 rows, 8 per power of two above.
    assert len({m for n, m in sizes.items() if n >= small}) <= 7 + 8 + 8 * 9 + 1
    assert [padded_row_count(n) for n in (1, 15, 16, 17, 64, 65, 128, 129, 256, 257)] == [
        1, 15, 16, 24, 64, 72, 128, 144, 256, 288]


def test_padded_row_count_takes_any_integer():
    np = pytest.importorskip("numpy")
    assert padded_row_count(np.int64(17)) == 24
    with pytest.raises(TypeError):
        padded_row_count(17.0)


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
@pytest.mark.parametrize("scale", [1e6, float("inf")], ids=["huge", "inf"])
@pytest.mark.parametrize("fused", [False, True], ids=["rows", "row-index"])
def test_padding_rows_do_not_reach_outputs_or_gradients(fused, scale):
    """Expert 0 computes 24 rows for its 17 and expert 2 24 for its 21 (past the end). Expert 1's
    rows, the ones just after expert 0's, are a million times larger or infinite: nothing of them
    may reach the other experts."""
    cpu_gemm.set_cpu_gemm_backend("onednn")
    gen = torch.Generator().manual_seed(0)
    hidden, ffn, counts = 16, 8, [17, 20, 21]
    assert [padded_row_count(n) for n in counts] == [24, 24, 24]
    num_tokens = sum(counts)
    neighbour = slice(17, 37)
    x = torch.randn(num_tokens, hidden, generator=gen)
    x[neighbour] *= scale
    fc1 = torch.randn(3, 2 * ffn, hidden, generator=gen) * 0.3
    fc2 = torch.randn(3, hidden, ffn, generator=gen) * 0.3
    probs = torch.rand(num_tokens, generator=gen)
    grad = torch.randn(num_tokens, hidden, generator=gen)
    grad[neighbour] *= scale
    # Token 0 (the row index's padding past the end) belongs to expert 0: a real gather source.
    row_index = torch.arange(num_tokens) if fused else None

    def run(fn, *args):
        leaves = [t.clone().requires_grad_() for t in (x, fc1, fc2, probs)]
        out = fn(*leaves, *args)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]

    got = run(lambda *t: expert_mlp(*t, counts, row_index=row_index, num_out_rows=num_tokens))
    want = run(lambda *t: reference_expert_mlp(*t, counts))
    for rows, expert in ((slice(0, 17), 0), (slice(37, 58), 2)):
        for name, g, w in (("out", got[0][rows], want[0][rows]), ("x", got[1][rows], want[1][rows]),
                           ("probs", got[4][rows], want[4][rows]), ("fc1", got[2][expert], want[2][expert]),
                           ("fc2", got[3][expert], want[3][expert])):
            assert bool(w.isfinite().all()), (name, expert)
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item(), msg=f"{name} {expert}")


def test_mkldnn_disabled_means_aten(monkeypatch):
    cpu_gemm.set_cpu_gemm_backend("onednn" if cpu_gemm.onednn_available() else "aten")
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert gemm_for(torch.device("cpu"), torch.float32, 512, 1024) is AtenGemm


def test_use_cpu_gemm_backend_restores_the_previous_setting():
    cpu_gemm.set_cpu_gemm_backend("aten")
    with cpu_gemm.use_cpu_gemm_backend(" AUTO "):
        assert cpu_gemm.cpu_gemm_backend() == "auto"
    assert cpu_gemm.cpu_gemm_backend() == "aten"
    with pytest.raises(RuntimeError, match="boom"), cpu_gemm.use_cpu_gemm_backend("auto"):
        raise RuntimeError("boom")
    assert cpu_gemm.cpu_gemm_backend() == "aten"


def test_probes_ignore_the_callers_autocast_default_device_and_dtype():
    """The first forward may run under bf16 autocast, a meta default device or float64 defaults:
    the probes must not depend on them (their results are kept for the whole process)."""
    plain = cpu_gemm.onednn_available()
    cpu_gemm.onednn_available.cache_clear()
    cpu_gemm._measure.cache_clear()
    try:
        torch.set_default_dtype(torch.float64)  # restored after the test by conftest's _torch_global_state
        with torch.device("meta"), torch.autocast("cpu", dtype=torch.bfloat16):
            in_context = cpu_gemm.onednn_available()
            choice = cpu_gemm._measured_choice(64, 128)
    finally:
        cpu_gemm.onednn_available.cache_clear()
        cpu_gemm._measure.cache_clear()
    assert in_context == plain
    assert choice in ("aten", "onednn")


def test_auto_follows_the_measurement(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: True)
    for measured, expected in (("onednn", OneDnnGemm), ("aten", AtenGemm)):
        monkeypatch.setattr(cpu_gemm, "_measured_choice", lambda i, o, m=measured: m)
        assert gemm_for(torch.device("cpu"), torch.float32, 512, 1024) is expected
