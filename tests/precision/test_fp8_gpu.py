"""FP8 on a GPU: the real scaled GEMMs against their emulation, FP8 layers and training against bf16.

Run by ``benchmarks/gpu_check.sh`` on one H200 (``pytest tests/precision -m "gpu or te" -s``
prints the timings). ``gpu`` tests need nothing beyond torch; ``te`` tests need Transformer Engine
and are skipped where it is not installed. Timings are printed, not asserted.

Baselines are bf16 models (weights and activations; routers compute in fp32), so the bf16 expert
kernel is ``grouped_mm`` with bf16 operands; the FP8 models are the same models converted.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers.asserts import exceeds
from helpers.lit import LossRecordingLM
from torch.utils.data import DataLoader

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.plugins import MoEFP8Precision
from lightning_moe.precision import (
    TorchFP8Recipe,
    convert_to_float8,
    float8_grouped_linear,
    float8_linear,
    quantize,
    scaled_mm_nt,
)
from lightning_moe.precision.torch_fp8 import E4M3, E5M2
from lightning_moe.precision.torch_fp8_experts import resolve_impl

# Same quantised operands on both sides; the difference is the GEMM's bf16 output rounding (2^-9)
# and, in the forward GEMM, Hopper's fast accumulation: compared norm-wise.
KERNEL_REL_TOL = 1e-2
# e4m3 GEMMs against bf16: 3 mantissa bits (see tests/precision/test_fp8_rules.py).
FP8_REL_TOL = 0.08
# FP8 training tracks bf16 training of the same model and data: relative gap of the losses
# (quantisation noise of a few percent per GEMM; the usual bound for short FP8-vs-bf16 runs).
LOSS_REL_TOL = 0.05
# Over the 40-step curve, which falls steeply (5.6 -> 2.2 nats), a small lag shows as a gap of a
# few percent at single steps: the mean gap measures tracking, the last step is checked loosely.
# Calibrated on CPU with the emulated GEMMs (fp32 master weights): mean 0.8%, max 5.9%, last 4%.
CURVE_MEAN_REL_TOL = 0.03
CURVE_LAST_REL_TOL = 0.08


def _rel(actual, expected) -> float:
    actual, expected = actual.detach().float(), expected.detach().float()
    return float((actual - expected).norm() / expected.norm())


@pytest.mark.gpu
@pytest.mark.parametrize(("rowwise", "b_dtype"), [(True, E4M3), (False, E4M3), (False, E5M2)])
def test_cuda_scaled_mm_equals_the_dequantised_product(rowwise, b_dtype):
    a = torch.randn(200, 256, device="cuda")
    b = torch.randn(384, 256, device="cuda")
    out = scaled_mm_nt(a, b, E4M3, b_dtype, rowwise=rowwise, out_dtype=torch.float32)
    dim = -1 if rowwise else None
    qa, sa = quantize(a, E4M3, dim)
    qb, sb = quantize(b, b_dtype, dim)
    expected = (qa.float() * sa) @ (qb.float() * sb).t()
    assert _rel(out, expected) < KERNEL_REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("impl", "counts"),
    [("grouped", [128, 0, 64, 320]), ("loop", [128, 0, 64, 320]), ("loop", [5, 27, 0, 480])],
)
@pytest.mark.parametrize("wgrad_fp8", [True, False])
def test_cuda_grouped_gemms_equal_the_emulation(impl, counts, wgrad_fp8):
    """Forward, dgrad and wgrad of the real grouped FP8 GEMMs against the dequantised emulation.

    Segments that are multiples of 16 (router padding) for the grouped kernel; the per-expert loop
    also with unaligned segments (zero-padded where a GEMM contracts over them).
    """
    if impl == "grouped" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._scaled_grouped_mm needs sm90+")
    x = torch.randn(sum(counts), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(4, 512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(sum(counts), 512, device="cuda", dtype=torch.bfloat16)
    results = {}
    for name in ("emulate", impl):
        x.grad = weight.grad = None
        out = float8_grouped_linear(x, weight, counts, TorchFP8Recipe(wgrad_fp8=wgrad_fp8), impl=name)
        out.backward(grad)
        results[name] = (out.detach(), x.grad.clone(), weight.grad.clone())
    for label, real, emulated in zip(("out", "dgrad", "wgrad"), results[impl], results["emulate"]):
        assert _rel(real, emulated) < KERNEL_REL_TOL, label


@pytest.mark.gpu
def test_float8_linear_tracks_bf16():
    x = torch.randn(4, 256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(2048, 1024, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = float8_linear(x, weight, None, TorchFP8Recipe())
    out.backward(torch.ones_like(out))
    x_ref, w_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = F.linear(x_ref, w_ref)
    ref.backward(torch.ones_like(ref))
    assert out.dtype == torch.bfloat16
    assert _rel(out, ref) < FP8_REL_TOL
    assert _rel(x.grad, x_ref.grad) < FP8_REL_TOL
    assert _rel(weight.grad, w_ref.grad) < FP8_REL_TOL


def _moe_layer(hidden, ffn, experts, **overrides) -> MoELayer:
    torch.manual_seed(0)
    fields = dict(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, top_k=2, router_padding_alignment=16)
    fields.update(overrides)
    return MoELayer(MoEConfig(**fields)).cuda().to(torch.bfloat16)


@pytest.mark.gpu
def test_float8_moe_layer_output_close_to_bf16():
    bf16 = _moe_layer(512, 256, 8)
    fp8 = _moe_layer(512, 256, 8)
    convert_to_float8(fp8, TorchFP8Recipe())
    hidden = torch.randn(4, 512, 512, device="cuda", dtype=torch.bfloat16)
    outs = []
    for layer in (bf16, fp8):
        x = hidden.clone().requires_grad_()
        out = layer(x)
        out.float().square().mean().backward()
        outs.append((out, x.grad, layer.experts.fc1_weight.grad, layer.router.weight.grad))
    for label, actual, expected in zip(("out", "dx", "dfc1", "drouter"), outs[1], outs[0]):
        assert _rel(actual, expected) < 2 * FP8_REL_TOL, label


@pytest.mark.gpu
def test_float8_moe_layer_speed_at_gemm_bound_size():
    """Forward+backward of one MoE layer, bf16 grouped_mm against FP8 grouped GEMMs (printed)."""
    tokens, hidden, ffn, experts = 16384, 4096, 2048, 8
    layers = {"bf16": _moe_layer(hidden, ffn, experts), "fp8": _moe_layer(hidden, ffn, experts)}
    convert_to_float8(layers["fp8"], TorchFP8Recipe())
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    counts = [tokens * 2 // experts] * experts
    assert resolve_impl("auto", x.device, counts, 2 * ffn, hidden) == "grouped"
    times = {}
    for name, layer in layers.items():
        def step(layer=layer):
            out = layer(x)
            out.backward(torch.ones_like(out))

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            step()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 10
    flops = 6 * 2 * tokens * (3 * hidden * ffn)  # fwd+bwd, top-2, three F x H matrices (SwiGLU)
    print(f"\n[fp8] MoE layer T={tokens} H={hidden} F={ffn} E={experts}: bf16 {times['bf16']:.2f} ms "
          f"({flops / times['bf16'] / 1e9:.0f} TFLOP/s), fp8 {times['fp8']:.2f} ms "
          f"({flops / times['fp8'] / 1e9:.0f} TFLOP/s), speed-up {times['bf16'] / times['fp8']:.2f}x")


def _lm(seed: int = 0) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer(MoETransformerConfig(
        vocab_size=256, hidden_size=256, num_layers=4, num_attention_heads=8, ffn_hidden_size=512,
        moe_layer_freq=[0, 1, 1, 1],
        moe=MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=8, top_k=2, load_balancing=["aux_loss"],
                      aux_loss_coeff=1e-2, shared_expert_ffn_hidden_size=128),
    ))


def _lm_batches(steps: int, batch: int = 8, seq: int = 128) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # A learnable stream: a few repeated random sequences, so the loss falls well below ln(256).
    motifs = torch.randint(0, 256, (16, seq + 1), generator=g)
    return [motifs[torch.randint(0, 16, (batch,), generator=g)] for _ in range(steps)]


@pytest.mark.gpu
def test_fp8_training_of_the_reference_model_tracks_bf16():
    curves = {}
    for name in ("bf16", "fp8"):
        model = _lm().cuda().to(torch.bfloat16)
        if name == "fp8":
            report = convert_to_float8(model, TorchFP8Recipe())
            assert report.converted
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for tokens in _lm_batches(40):
            tokens = tokens.cuda()
            loss = model.loss(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        curves[name] = losses
    bf16, fp8 = torch.tensor(curves["bf16"]), torch.tensor(curves["fp8"])
    print(f"\n[fp8] reference model loss bf16 {bf16[0]:.3f} -> {bf16[-1]:.3f}, fp8 {fp8[0]:.3f} -> {fp8[-1]:.3f}")
    assert bf16[-1] < 0.7 * math.log(256), "the bf16 run must learn for the comparison to mean anything"
    gap = (fp8 - bf16).abs() / bf16
    print(f"[fp8] relative loss gap: mean {gap.mean():.4f}, max {gap.max():.4f}, last {gap[-1]:.4f}")
    assert gap.mean() < CURVE_MEAN_REL_TOL and gap[-1] < CURVE_LAST_REL_TOL


def _max_relative_gap(losses: list[float], baseline: list[float]) -> float:
    """Largest relative loss gap, NaN if any loss is NaN (a plain max() would skip it)."""
    assert len(losses) == len(baseline) > 0
    gaps = torch.tensor([abs(a - b) / b for a, b in zip(losses, baseline)], dtype=torch.float64)
    return gaps.max().item()  # torch.max propagates NaN


def _fit(**trainer_kwargs) -> LossRecordingLM:
    module = LossRecordingLM(_lm(), optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_steps=10, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, **trainer_kwargs,
    )
    trainer.fit(module, DataLoader(torch.stack(_lm_batches(10)).flatten(0, 1), batch_size=8))
    return module


@pytest.mark.gpu
def test_trainer_with_the_torch_plugin_tracks_bf16():
    baseline = _fit(precision="bf16-true")
    plugin = MoEFP8Precision(backend="torch", first_last_bf16=True, weights_dtype="bfloat16")
    fp8 = _fit(plugins=[plugin])
    assert "model.layers.1.ffn.experts" in plugin.report.converted
    assert "model.layers.0.attn.q_proj" in plugin.report.skipped
    assert fp8.model.config.moe.router_padding_alignment == 16
    assert all(layer.ffn.router.weight.dtype == torch.float32 for layer in fp8.model.layers[1:])
    gap = _max_relative_gap(fp8.losses, baseline.losses)
    print(f"\n[fp8] Trainer bf16-true vs MoEFP8Precision(torch): max relative loss gap {gap:.4f}")
    assert not exceeds(gap, LOSS_REL_TOL)


@pytest.mark.gpu
def test_fp8_experts_inside_a_whole_layer_cuda_graph():
    """Drop-and-pad FP8 experts build their offsets on the device, so the 'moe' scope captures them."""
    from lightning_moe.graphs import CUDAGraphManager

    layer = torch.nn.Sequential(_moe_layer(256, 128, 8, router_padding_alignment=None, capacity_factor=1.0,
                                           pad_to_capacity=True))
    convert_to_float8(layer, TorchFP8Recipe())
    manager = CUDAGraphManager(layer, ["moe"])
    x = torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with manager.recording_step():
        layer(x).sum().backward()
    out = layer(x)
    out.sum().backward()
    assert manager.stats()["0.moe"]["replays"] == 1 and torch.isfinite(out).all()
    manager.release()


@pytest.mark.te
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4"])
def test_trainer_with_the_te_plugin(recipe):
    from lightning_moe.precision.te_fp8 import available_te_recipes

    if recipe not in available_te_recipes():
        pytest.skip(f"the installed Transformer Engine has no {recipe!r} recipe")
    capability = torch.cuda.get_device_capability()
    if recipe in ("mxfp8", "nvfp4") and capability < (10, 0):
        pytest.skip(f"{recipe} needs a Blackwell GPU, this one is sm{capability[0]}{capability[1]}")
    baseline = _fit(precision="bf16-true")
    plugin = MoEFP8Precision(backend="te", recipe=recipe, weights_dtype="bfloat16")
    fp8 = _fit(plugins=[plugin])
    assert "model.layers.1.attn.q_proj" in plugin.report.converted
    gap = _max_relative_gap(fp8.losses, baseline.losses)
    print(f"\n[fp8] Trainer bf16-true vs MoEFP8Precision(te, {recipe}): max relative loss gap {gap:.4f}")
    assert not exceeds(gap, LOSS_REL_TOL)
    state = fp8.state_dict()
    assert any(key.endswith("_extra_state") for key in state), "TE's FP8 metadata is part of the checkpoint"
