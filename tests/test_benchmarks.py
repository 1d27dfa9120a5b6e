"""Smoke tests of the benchmark scripts: they run end to end at tiny settings and print their tables.

Each script runs in a subprocess, as a user would run it; timings are not checked (noisy
machine), only the exit status, the rows of the markdown tables and that the ``--output`` file
holds what was printed. Hugging Face rows are expected only where ``transformers`` (the ``bench``
extra) is installed; otherwise the script must list them as skipped.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from lightning_moe.layers import cpu_gemm

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None  # found, not imported: collection stays fast


def _run(script: str, *args: str, timeout: float = 180, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=timeout,
        cwd=BENCHMARKS.parent, env=None if env is None else {**os.environ, **env},
    )
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _rows(text: str) -> dict[str, list[str]]:
    """Markdown table rows by their first cell (header and separator rows excluded)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and not line.startswith("|---") and cells[0] not in ("case", "run"):
            rows[cells[0]] = cells[1:]
    return rows


def _ratio(cell: str) -> float:
    match = re.fullmatch(r"([0-9.]+)x.*", cell)
    assert match, cell
    return float(match.group(1))


@pytest.mark.parametrize("backend", [
    "aten",
    pytest.param("onednn", marks=pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="no usable oneDNN")),
])
def test_moe_layer_smoke(tmp_path, backend):
    output = tmp_path / "moe_layer.md"
    out = _run("moe_layer.py", "--configs", "S", "--rounds", "1", "--peers", "none", "--dtypes", "fp32",
               "--output", str(output), env={cpu_gemm.ENV_VAR: backend})
    assert "### S fp32: tokens 2048, hidden 512" in out
    rows = _rows(out)
    onednn = ["floor: 9 GEMMs per expert through oneDNN"] if backend == "onednn" else []
    same_layer_on_aten = [
        "lightning_moe MoELayer [new routing every step]", "lightning_moe MoELayer [CPU GEMMs through torch.mm]",
    ] if backend == "onednn" else []
    expected = [
        "floor: 9 grouped_mm GEMMs", "floor: 9 bmm GEMMs [E, N/E, *]", *onednn, "lightning_moe MoELayer",
        *same_layer_on_aten, "lightning_moe MoELayer [kernel=grouped_mm]",
        "overhead: lightning_moe router + permutation",
        "lightning_moe MoELayer [kernel=grouped_mm, experts frozen]",
        "lightning_moe MoELayer + LoRA r=16 [grouped_mm, experts frozen]",
    ]
    assert list(rows) == expected, list(rows)
    assert "LoRA layer / plain layer (r=16, both frozen, grouped_mm): " in out
    assert rows["floor: 9 grouped_mm GEMMs"][2] == "1.000x"  # every ratio is to this floor
    for name in expected:
        assert _ratio(rows[name][2]) > 0, name
        assert "routing:" in rows[name][-1], name
    assert output.read_text().strip() == out.strip()


@pytest.mark.distributed  # the script forks 2 gloo ranks per multi-process run
def test_train_throughput_smoke(tmp_path):
    output = tmp_path / "train_throughput.md"
    out = _run("train_throughput.py", "--steps", "2", "--warmup", "1", "--layers", "1", "--hidden", "64",
               "--ffn", "64", "--seq", "32", "--batch", "2", "--output", str(output))
    rows = _rows(out)
    ours = ["ours-1", "ours-ddp2", "ours-ep2"]
    hf = ["hf-1", "hf-ddp2"]
    if HAS_TRANSFORMERS:
        assert list(rows) == ["ours-1", "hf-1", "ours-ddp2", "hf-ddp2", "ours-ep2"], list(rows)
        assert "DDPStrategy" in rows["hf-ddp2"][-1]
        assert rows["ours-ddp2"][-2].endswith("vs hf-ddp2") and rows["ours-1"][-2].endswith("vs hf-1")
    else:
        assert list(rows) == ours, list(rows)
        assert all(f"{case} (transformers is not installed" in out for case in hf)
    for case in rows:
        tokens_per_s = float(rows[case][1].replace(",", ""))
        assert tokens_per_s > 0, (case, rows[case])
        assert re.fullmatch(r"[0-9]+\.[0-9]%", rows[case][5]), (case, rows[case])  # MFU (0.0% when heavily loaded)
    assert output.read_text().strip() in out


def test_memory_grad_sync_smoke(tmp_path):
    # Byte counts are exact: the persistent bucket buffers stay within one copy of the gradients
    # plus flags plus one bucket; the concatenating scheme before them held two copies.
    output = tmp_path / "memory.md"
    out = _run("memory.py", "--grad-sync", "--output", str(output))
    lines = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| reducer")]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    assert [(r[0], r[1]) for r in rows] == [
        (reducer, micro)
        for micro in ("1", "2")
        for reducer in ("concatenated flat per bucket (before)", "GradSync: persistent bucket buffers")
    ], rows
    for reducer, _, peak, one_copy, ratio, *_, within, same in rows:
        assert same == "yes", rows
        if reducer.startswith("GradSync"):
            assert within == "yes" and int(peak) < 1.2 * int(one_copy), rows
        else:
            assert ratio == "2.000", rows
    assert output.read_text().strip().endswith(lines[-1])


def test_cp_attention_smoke(tmp_path):
    output = tmp_path / "cp_attention.md"
    out = _run("cp_attention.py", "--seq", "64", "--heads", "2", "--head-dim", "16", "--rounds", "1",
               "--output", str(output))
    rows = _rows(out)
    assert list(rows) == ["sdpa", "ring fused", "ring math", "all_gather"], list(rows)
    assert _ratio(rows["sdpa"][2]) == 1.0
    assert output.read_text().strip() == out.strip()


def test_pipeline_bubble_smoke():
    # The measured bubble is noisy on shared cores; the smoke test checks the row and the theory only.
    out = _run("pipeline_bubble.py", "--schedules", "1F1B", "--microbatches", "4", "--rounds", "1")
    (row,) = [line for line in out.splitlines() if line.startswith("| 1F1B")]
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    assert cells[0] == "1F1B M=4 V=1" and cells[4] == "0.200", cells  # (P-1)/(M+P-1) with P=2, M=4
    assert float(cells[1]) > 0 and float(cells[2]) > 0, cells


def test_scale_memory_smoke(tmp_path):
    """The first layout (Mixtral 8x7B, world 64, TP=8, EP=8): its parameters are the formula's, the
    state columns follow from them (fp32 gradients, two fp32 moments), the first step's transient
    holds at least what its optimizer step keeps beside the state (the bf16 copies of the local
    experts that bf16-mixed computes with; fused AdamW updates in place), and the checkpoint save
    allocates nothing beyond the shards."""
    from models.test_presets import load_preset
    from scale.formula import local_parameters
    from scale.step_formula import local_experts_parameters

    from lightning_moe.parallel import ParallelDims

    output = tmp_path / "scale.md"
    out = _run("scale_memory.py", "--quick", "--output", str(output), timeout=280)  # under pytest-timeout's 300 s
    (row,) = [line for line in out.splitlines() if line.startswith("| mixtral_8x7b")]
    cells = [c.strip() for c in row.split("<!--")[0].strip().strip("|").split("|")]
    name, layout, local, params, grads, optimizer, setup, setup_ratio, step, transient, save, megatron, ours = cells
    config, dims = load_preset("mixtral_8x7b"), ParallelDims(world_size=64, tp=8, ep=8, etp=1)
    elements = local_parameters(config, dims)
    assert (name, layout) == ("mixtral_8x7b", "W64 TP8 EP8")
    assert local == f"{elements / 1e9:.3f}B"
    # fp32 parameters and gradients, two fp32 moments, 16 bytes in all per element.
    assert [params, grads, optimizer, ours] == [f"{n * elements / 2**30:.2f}" for n in (4, 4, 8, 16)]
    assert float(setup_ratio) >= 1.0 and float(setup) >= float(params)
    optimizer_step = 2 * local_experts_parameters(config, dims) / 2**30
    assert float(step) >= float(ours) and float(transient) >= round(optimizer_step, 2)
    assert save == "0.00"
    assert float(megatron) > 0
    assert output.read_text().splitlines()[-1] == row.split(" <!--")[0]


def _load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dispatch_benchmark_reports_a_nan_error_as_a_failure():
    """In process, on made-up per-rank results: a NaN on one rank fails whatever the rank order
    (Python's ``max(0.0, nan)`` is 0.0), and so does an error above the tolerance."""
    dispatch = _load_benchmark("dispatch")

    def rank(error: dict) -> dict:
        return {"error": error, "scale": 2.0}

    for per_rank in ([rank({"a": 0.0, "b": 1e-7}), rank({"a": float("nan"), "b": 1e-7})],
                     [rank({"a": float("nan"), "b": 1e-7}), rank({"a": 0.0, "b": 1e-7})]):
        assert dispatch.error_failures(per_rank, 1e-5) == ["a"]
        worst = dispatch.worst_errors(per_rank)
        assert worst["a"] != worst["a"] and worst["b"] == 1e-7  # NaN
    assert dispatch.error_failures([rank({"a": 3e-5})], 1e-5) == ["a"]  # above 1e-5 x the largest output 2.0
    assert dispatch.error_failures([rank({"a": 1.9e-5})], 1e-5) == []


def test_plan_vs_measured_smoke(tmp_path):
    """One layout (CP=2 x EP=2): the plan's parameter, gradient and optimizer bytes are the real
    run's, its activations and peak within 10% (as tests/planning/test_plan_vs_measured.py asks),
    and the ``--output`` file holds the printed table."""
    output = tmp_path / "plan.md"
    out = _run("plan_vs_measured.py", "--layouts", "cp2-ep2", "--output", str(output))
    (cells,) = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()
                if line.startswith("| cp2-ep2")]
    assert cells[:2] == ["cp2-ep2", "0"], cells
    quantities = [cells[2 + 3 * i : 5 + 3 * i] for i in range(5)]  # params, grads, optimizer, activations, peak
    for planned, measured, ratio in quantities[:3]:
        assert planned == measured and ratio == "1.000", quantities
    for planned, measured, ratio in quantities[3:]:
        assert 0.9 <= float(ratio) <= 1.1 and abs(float(planned) / float(measured) - float(ratio)) < 2e-3, quantities
    assert float(cells[17]) > 0 and float(cells[18]) > 0, cells  # wall times
    assert output.read_text().strip() == out.strip()


def test_plan_gpu_check_measures_the_second_optimizer_step(monkeypatch):
    """In process, without a GPU: `StepPeak` resets the CUDA peak at the first micro-batch of
    optimizer step 1 and reads it after that step's last micro-batch (two micro-batches per step),
    and never again."""
    check = _load_benchmark("plan_gpu_check")
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 100)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: calls.append("read") or 1000)
    monkeypatch.setattr(check, "cuda_tensor_bytes", lambda held: 40)
    meter = check.StepPeak()
    trainer = types.SimpleNamespace(global_step=0, accumulate_grad_batches=2, optimizers=[])
    module = torch.nn.Linear(2, 2)
    for batch_idx in range(8):  # optimizer steps 0..3, two micro-batches each
        meter.on_train_batch_start(trainer, module, None, batch_idx)
        calls.append(("start", trainer.global_step, batch_idx))
        trainer.global_step += batch_idx % 2  # the optimizer steps after the second micro-batch
        meter.on_train_batch_end(trainer, module, None, None, batch_idx)
        calls.append(("end", trainer.global_step, batch_idx))
    assert calls.index("reset") == calls.index(("start", 1, 2)) - 1, calls
    assert calls.index("read") == calls.index(("end", 2, 3)) - 1, calls
    assert calls.count("reset") == calls.count("read") == 1, calls
    assert (meter.peak, meter.start_allocated, meter.start_tensors) == (1000, 100, 40)
