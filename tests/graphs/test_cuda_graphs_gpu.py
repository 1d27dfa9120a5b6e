"""Real CUDA graphs on a GPU: loss curves equal eager for every scope set, replay timings, Trainer wiring.

Run by ``benchmarks/gpu_check.sh`` on one H200 (``pytest tests/graphs -m gpu -s`` prints the
timing table). Each captured stage replayed alone equals its eager run; timings are reported, not
asserted (one run's ratio is no test): replay should beat eager for the captured part (launch
overhead of many small kernels disappears), and the printed ratios show by how much.

The MoE runs keep the model in bf16 (weights and activations, routers computing in fp32: Lightning's
``bf16-true``), so the eager expert kernel is ``grouped_mm`` with bf16 operands. Capture under
autocast (``bf16-mixed``) is checked on a dense model: the expert kernels do not run under autocast
yet (their fp32 accumulators meet autocast's bf16 GEMM outputs).
"""

from __future__ import annotations

import statistics
import warnings

import lightning as L
import pytest
import torch
from graphs.tiny import DROP_AND_PAD, SCOPE_SETS, batches, stage_results, tiny_model, train
from helpers.asserts import assert_close_to_scale
from helpers.lit import LossRecordingLM
from torch.utils.data import DataLoader

from lightning_moe.callbacks.cuda_graphs import CUDAGraphCapture
from lightning_moe.graphs import CUDAGraphManager

pytestmark = pytest.mark.gpu

STEPS, WARMUP = 20, 3
# bf16: eager and replayed kernels are the same, but scatter-adds (expert combine) use
# atomics whose order differs run to run; over 20 SGD steps the losses agree to bf16 precision.
BF16_LOSS_RTOL = 1e-2
# One stage replayed against eager on the same inputs: the same kernels, but the expert combine's
# bf16 scatter-adds (atomics) sum in another order; relative to each tensor's largest value.
REPLAY_TOL = 2e-2
SHAPES = dict(hidden=256, num_layers=4, num_experts=8, ffn=256)
BATCH, SEQ, MICRO = 4, 128, 2

_eager_cache: dict[str, tuple[list[float], list[float]]] = {}


def _run(moe: dict, scopes=None):
    model = tiny_model(moe, **SHAPES).cuda().to(torch.bfloat16)
    data = batches(STEPS, MICRO, BATCH, SEQ, device="cuda")
    # bf16 weights: a learning rate large enough that the updates survive bf16 rounding.
    return train(model, data, scopes, warmup_steps=WARMUP, backend="cuda", lr=0.5)


def _eager(moe: dict) -> tuple[list[float], list[float]]:
    key = repr(sorted(moe.items()))
    if key not in _eager_cache:
        losses, _, times = _run(moe)
        _eager_cache[key] = (losses, times)
    return _eager_cache[key]


@pytest.mark.parametrize(("scopes", "moe"), SCOPE_SETS)
def test_graphed_loss_curve_equals_eager(scopes, moe):
    eager_losses, eager_times = _eager(moe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the 'moe' scope's kernel swap note
        losses, manager, times = _run(moe, scopes)
    torch.testing.assert_close(losses, eager_losses, rtol=BF16_LOSS_RTOL, atol=0)
    stats = manager.stats()
    assert all(s["replays"] == (STEPS - WARMUP) * MICRO and s["eager_fallbacks"] == 0 for s in stats.values()), stats
    pools = {stage._fwd_graph.pool() for stage in manager.stages}
    assert len(pools) == 1, "every graph of a manager shares one memory pool"
    eager_step = statistics.median(eager_times[WARMUP + 1 :])
    graph_step = statistics.median(times[WARMUP + 1 :])
    print(f"\n[cuda-graphs] scopes={'+'.join(scopes):<36} step eager {eager_step * 1e3:7.2f} ms  "
          f"graphed {graph_step * 1e3:7.2f} ms  ratio {eager_step / graph_step:5.2f}x")
    manager.release()


def _time(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@pytest.mark.parametrize(("scopes", "moe"), [(("attn", "moe_router", "moe_preprocess"), {}), (("attn", "moe"), DROP_AND_PAD)])
def test_replay_of_each_captured_stage_equals_eager(scopes, moe):
    """Forward+backward of each captured stage of the first layer alone, replayed against eager on
    the same inputs: outputs and every input and parameter gradient (the fwd+bwd times are printed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _, manager, _ = _run(moe, scopes)
    stages = [s for s in manager.stages if s.name.startswith("layers.0.")]
    assert stages, [s.name for s in manager.stages]
    rows = []
    for stage in stages:
        eager, replayed = stage_results(stage, replay=False), stage_results(stage, replay=True)
        assert len(replayed) == len(eager), stage.name
        for index, (got, want) in enumerate(zip(replayed, eager)):
            assert (got is None) == (want is None), f"{stage.name} result {index}: one of them is None"
            if want is not None:
                assert_close_to_scale(got, want, REPLAY_TOL, f"{stage.name} result {index}")
        rows.append((stage.name, _time(lambda s=stage: stage_results(s, False)),
                     _time(lambda s=stage: stage_results(s, True))))
    for name, eager_ms, replay_ms in rows:
        print(f"\n[cuda-graphs] {name:<40} fwd+bwd eager {eager_ms:7.3f} ms  replay {replay_ms:7.3f} ms  "
              f"ratio {eager_ms / replay_ms:5.2f}x")
    manager.release()


def test_capture_under_autocast_equals_eager():
    """bf16-mixed: the stages are captured inside the recorded autocast state (weight-cast cache off)."""
    curves = []
    for scopes in (None, ("attn",)):
        model = tiny_model(dense=True, **SHAPES).cuda()
        data = batches(STEPS, MICRO, BATCH, SEQ, device="cuda")
        losses, manager, _ = train(model, data, scopes, warmup_steps=WARMUP, backend="cuda", autocast_dtype=torch.bfloat16)
        curves.append(losses)
    torch.testing.assert_close(curves[1], curves[0], rtol=BF16_LOSS_RTOL, atol=0)
    stage = manager.stages[0]
    assert stage._signature[-1] == (True, torch.bfloat16) and stage.replays == (STEPS - WARMUP) * MICRO


def test_random_ops_draw_fresh_numbers_on_every_replay():
    model = tiny_model({"input_jitter_eps": 0.1}, **SHAPES).cuda().to(torch.bfloat16)
    data = batches(4, 1, BATCH, SEQ, device="cuda")
    losses, manager, _ = train(model, data, ("moe_router",), warmup_steps=1, backend="cuda")
    assert all(torch.isfinite(torch.tensor(losses)))
    stage = manager.stages[0]
    tokens = data[0][0]
    outs = []
    for _ in range(2):
        model.zero_grad()
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        outs.append(stage._static_outputs[1].clone())  # the router's probs of the replay
    assert not torch.equal(outs[0], outs[1]), "the jitter noise must change between replays"


def test_moe_scope_swaps_the_grouped_mm_kernel_for_capture_and_restores_it():
    model = tiny_model(DROP_AND_PAD, **SHAPES).cuda()
    experts = model.layers[0].ffn.experts
    assert experts.resolved_kernel(experts.fc1_weight.device) == "grouped_mm"
    with pytest.warns(UserWarning, match="grouped_mm expert kernel copies its offsets from the host"):
        manager = CUDAGraphManager(model, ["moe"])
    assert experts.kernel == "loop"
    manager.release()
    assert experts.kernel == "auto"


def _fit(callbacks):
    data = torch.cat([b[0] for b in batches(10, 1, BATCH, SEQ)])
    module = LossRecordingLM(tiny_model({}, **SHAPES))
    trainer = L.Trainer(
        accelerator="gpu", devices=1, precision="bf16-true", max_steps=10, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks,
    )
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    return module


def test_trainer_with_the_callback_equals_eager():
    eager = _fit([])
    callback = CUDAGraphCapture(scopes=["attn", "moe_router", "moe_preprocess"], warmup_steps=3)
    graphed = _fit([callback])
    torch.testing.assert_close(graphed.losses, eager.losses, rtol=BF16_LOSS_RTOL, atol=0)
    assert all(s["replays"] == 7 for s in callback.stats().values()), callback.stats()
