"""`lightning-moe plan` against a real training step on one GPU: planned peak vs ``max_memory_allocated``.

One configuration, ``examples/configs/tiny_cpu.yaml`` on one GPU (``--trainer.accelerator=gpu
--trainer.devices=1``), the layout overridden to TP=1, EP=1, ``bf16-mixed``; extra ``fit``
overrides may follow on the command line (e.g. a larger ``--data.batch_size``). Printed:

* ``planned``: the plan's peak (``lightning_moe.planning.plan(ARGS).largest.step.peak_bytes``): the
  configuration's setup and second optimizer step run on fake tensors on the CPU, with the GPU's
  kernels' memory (``grouped_mm`` experts, flash attention), since the configuration asks for a GPU;
  routing planned perfectly balanced;
* ``measured``: the same configuration fitted for real on this GPU, shortened as the planner
  shortens it (two optimizer steps; no logger, checkpointing, sanity check or validation; only the
  memory callbacks kept), routing exactly balanced as the plan assumes
  (``tests/helpers/step_memory.exactly_balanced_routing``). `StepPeak` calls
  ``torch.cuda.reset_peak_memory_stats()`` at the start of optimizer step 1 (its first
  micro-batch) and reads ``torch.cuda.max_memory_allocated()`` at its end: the peak of the step,
  everything the rank holds included, as the plan's peak;
* ``outside tensors``: ``torch.cuda.memory_allocated()`` at that start minus the bytes (rounded up
  to the caching allocator's 512-byte blocks) of every CUDA storage a Python tensor holds then.
  These are allocations of no tensor: cuBLAS/cuBLASLt workspaces (one per handle and stream, kept
  from step 0 on: tens of MiB on a Hopper GPU), which the planner says it cannot see and which,
  for a model this small, would outweigh what it plans;
* ``ratio`` = planned / (measured - outside tensors), and ``raw ratio`` = planned / measured.

Exit status 1 when ``ratio`` is outside [0.8, 1.25], 2 without a CUDA device. Neither side sees the
allocator's reserve beyond the allocated bytes (fragmentation, ``memory_reserved``) or NCCL's own
buffers (one rank here).

The planner and the fit parse the configuration as ``lightning-moe fit`` does, with jsonargparse:
a GPU image without it gets it from ``benchmarks/gpu_check.sh``, which installs the wheels of
``$WHEELS_DIR`` (default ``benchmarks/wheels``) with ``pip --no-index`` before this step.

    python benchmarks/plan_gpu_check.py
    python benchmarks/plan_gpu_check.py --data.batch_size=32    # extra fit overrides
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import tempfile
import warnings

import lightning as L
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))  # the harness

from helpers.memory import tensors_in
from helpers.step_memory import exactly_balanced_routing

from lightning_moe.planning.plan_config import plan_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
_S = "--trainer.strategy.init_args."
ARGS = [
    "--config", CONFIG, "--trainer.accelerator=gpu", "--trainer.devices=1", "--trainer.num_nodes=1",
    "--trainer.precision=bf16-mixed", f"{_S}tensor_parallel_size=1", f"{_S}expert_parallel_size=1",
    f"{_S}expert_tensor_parallel_size=1",
]
"""``lightning-moe fit`` arguments of the checked configuration."""

MEASURE_STEP = 1
"""The optimizer step compared (0-based): the second, the first that runs with AdamW's moments (the plan's)."""
RATIO_RANGE = (0.8, 1.25)
_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to a multiple of this


class StepPeak(L.Callback):
    """``torch.cuda.max_memory_allocated()`` over optimizer step ``step``: the peak is reset at the
    step's first micro-batch and read after its last (the optimizer has stepped). Also keeps the
    allocated bytes at the reset (``start_allocated``) and those of Python-visible tensors then
    (``start_tensors``)."""

    def __init__(self, step: int = MEASURE_STEP) -> None:
        self.step = step
        self.peak: int | None = None
        self.start_allocated = self.start_tensors = 0
        self._open = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        """Open the window at the step's first micro-batch (the batch is on the device already)."""
        if self._open or trainer.global_step != self.step or batch_idx % trainer.accumulate_grad_batches:
            return
        torch.cuda.synchronize()
        params = list(pl_module.parameters())
        states = [v for opt in trainer.optimizers for state in opt.state.values() for v in state.values()]
        held = [*params, *(p.grad for p in params), *pl_module.buffers(), *states, *tensors_in(batch)]
        self.start_tensors = cuda_tensor_bytes(held)
        self.start_allocated = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self._open = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """Read the peak after the step's last micro-batch (global_step has moved on once it stepped)."""
        if self._open and self.peak is None and trainer.global_step == self.step + 1:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()


def cuda_tensor_bytes(held: list) -> int:
    """Bytes of the distinct CUDA storages of ``held`` and of every live Python tensor, each rounded
    up to the allocator's block (a DTensor: its local tensor). ``held``: what the step starts with
    (parameters, gradients, buffers, optimizer states, the batch), named because a tensor torch
    holds in C++ (a gradient never read from Python) has no Python object for ``gc`` to list."""
    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}
    for obj in [*held, *gc.get_objects()]:
        if not isinstance(obj, torch.Tensor):
            continue
        tensor = obj.to_local() if isinstance(obj, DTensor) else obj
        if not tensor.is_cuda:
            continue
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue  # a wrapper subclass without storage of its own: its inner tensors are listed too
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(-(-n // _BLOCK) * _BLOCK for n in storages.values())


def fit_cli(args: list[str], root: str):
    """``lightning-moe fit ARGS``'s CLI objects, not run, shortened as the planner shortens it (module
    docstring), routing forced balanced, on the configured GPU."""
    return plan_cli([*args, "--model.model.moe.force_load_balancing=true"], MEASURE_STEP, root, on_cpu=False)


def measure(args: list[str]) -> StepPeak:
    """Fit ``args`` for real on this GPU and return the `StepPeak` of optimizer step `MEASURE_STEP`."""
    with tempfile.TemporaryDirectory(prefix="plan-gpu-check-") as root:
        cli = fit_cli(args, root)
        meter = StepPeak()
        cli.trainer.callbacks.append(meter)
        with exactly_balanced_routing(cli.model.config.moe.top_k):
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if meter.peak is None:
        raise RuntimeError(f"optimizer step {MEASURE_STEP} never completed: the configured data holds too few batches.")
    return meter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _, extra = parser.parse_known_args(argv)  # everything else: fit overrides
    if not torch.cuda.is_available():
        print("plan_gpu_check: no CUDA device; nothing to compare.", file=sys.stderr)
        return 2
    from lightning_moe.planning import plan

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.simplefilter("ignore")
    args = [*ARGS, *extra]
    planned = plan(args).largest.step.peak_bytes  # first: its fake process group is gone before the real one
    meter = measure(args)
    outside = meter.start_allocated - meter.start_tensors
    ratio, raw = planned / (meter.peak - outside), planned / meter.peak
    mib = 2**20
    print(f"configuration: {' '.join(os.path.relpath(a, ROOT) if a == CONFIG else a for a in args)}")
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"planned peak            {planned / mib:10.2f} MiB")
    print(f"measured peak           {meter.peak / mib:10.2f} MiB  (max_memory_allocated over optimizer step {MEASURE_STEP})")
    print(f"  outside tensors       {outside / mib:10.2f} MiB  (allocated at the step's start {meter.start_allocated / mib:.2f} "
          f"MiB, in Python tensors {meter.start_tensors / mib:.2f} MiB)")
    print(f"ratio                   {ratio:10.3f}      (planned / (measured - outside tensors))")
    print(f"raw ratio               {raw:10.3f}      (planned / measured)")
    low, high = RATIO_RANGE
    if not low <= ratio <= high:
        print(f"plan_gpu_check: FAILED: the ratio {ratio:.3f} is outside [{low}, {high}].", file=sys.stderr)
        return 1
    print(f"plan_gpu_check: ok (ratio within [{low}, {high}])")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
