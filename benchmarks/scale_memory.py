"""Per-rank memory of the real presets at their typical layouts, measured on one CPU process.

Each preset of ``examples/configs/models/`` is built on the meta device and set up as one rank of
a world of 64-1024 on torch's fake process group (``tests/scale/fake_world.py``): ``parallelize``
applies the layout, then ``materialize`` gives the rank's shards storage and draws their values,
as ``MoEStrategy`` does, but under ``FakeTensorMode``, so nothing is allocated and every allocation
is counted, by the counter of the scale tests (``tests/helpers/live_bytes.py``; the step probe
``tests/scale/step_probe.py`` is one too). Printed per layout (the whole model, every layer):

* ``params`` / ``grads`` / ``optimizer``: bytes of the rank's shards under ``bf16-mixed``: fp32
  parameters (the master weights), fp32 gradients of the same local shapes, AdamW's two fp32
  moments;
* ``setup peak``: the largest live bytes while the shards are materialised and initialised, and
  its ratio to the rank's parameter bytes (1.0 = nothing beyond the shard ever lived); first and
  last rank, the larger shown. The drawn initial values are host memory on a GPU machine (layers
  draw on the CPU), counted here all the same;
* ``step peak``: the largest live bytes of rank 0's first two optimizer steps, the second's in
  practice: it runs with the Adam moments the first one created (``tests/scale/fake_step.py``: one
  micro-batch of 4096 tokens per step, what ``MoEStrategy`` runs under
  ``bf16-mixed``: the TP batch check, forward, vocabulary-parallel loss, backward with the
  gradient sync, the gradient guard, ``AdamW.step`` (fused, as ``MoELanguageModel`` asks on CUDA,
  under ``allow_mixed_tensors``); forced-balanced routing, the ``alltoall`` dispatcher, the GPU's expert
  kernel and flash attention's memory), and ``step transient``: that peak minus params, grads and
  optimizer states (activations, bf16 weight copies, temporaries);
* ``save transient``: the largest bytes beyond what rank 0 holds while it saves a sharded
  checkpoint after that step (``tests/scale/fake_save.py``: the model's ``state_dict()``, the
  optimizer's and ``torch.distributed.checkpoint.save`` with a writer that resolves each item as
  ``FileSystemWriter`` does, writing nothing); a gather in ``state_dict()`` shows here. DCP runs
  with ``no_dist`` (its plan exchange cannot run on the fake backend), so the coordinator's global
  plan and the writer's host-side staging are not counted;
* ``Megatron w+o``: the weight-and-optimizer bytes of Megatron-LM's ``report_theoretical_memory``
  formula (``megatron/training/theoretical_memory_usage.py``; not in the ``megatron-core`` wheel,
  so it is evaluated here from its published definition): the whole model's parameters, experts
  included, divided by TP (and the blocks by PP), times 18 bytes per parameter (bf16 weights, fp32
  gradients, fp32 master weights and two moments), or ``6 + 12 / DP`` with the distributed
  optimizer (the sharded rows). It divides routed experts by TP, not by EP x ETP, so it differs
  from the layout's arithmetic wherever EP x ETP != TP; and its distributed optimizer shards the
  optimizer state only, where FSDP2 shards parameters and gradients too.

The fake step runs NO_SHARD data parallelism only: sharded rows (``FULL_SHARD``) show the state and
the setup, not the step or the save (``-``). What this cannot show: allocator fragmentation and
caching, communicator buffers, GPU streams. ``benchmarks/gpu_check.sh`` measures the setup peak
against the shard with ``torch.cuda.max_memory_allocated`` on a real GPU.

    python benchmarks/scale_memory.py                      # the table, a few minutes on 2 cores
    python benchmarks/scale_memory.py --output scale.md    # also as markdown
    python benchmarks/scale_memory.py --quick              # the first layout only
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))  # scale harness

from models.test_presets import load_preset
from scale.fake_step import FakeRun, run_fake_steps
from scale.fake_world import sharded_preset
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims
from lightning_moe.planning.fake_world import fake_rank
from lightning_moe.planning.live_bytes import LiveBytes
from lightning_moe.strategies.model_setup import materialize

GIB = 2**30
SEQ_LEN = 4096
"""Tokens of each step's micro-batch (one sequence)."""

# (preset, layout, sharding): what a user would pick for each model at its scale, replicated and
# with FSDP2 (for the state that does not fit replicated; its rows measure setup and state only).
LAYOUTS = [
    ("mixtral_8x7b", ParallelDims(world_size=64, tp=8, ep=8, etp=1), "NO_SHARD"),
    ("mixtral_8x7b", ParallelDims(world_size=64, tp=8, ep=8, etp=1), "FULL_SHARD"),
    ("mixtral_8x7b", ParallelDims(world_size=64, tp=8, ep=4, etp=2), "NO_SHARD"),
    ("qwen3_30b_a3b", ParallelDims(world_size=128, tp=4, ep=32, etp=1), "NO_SHARD"),
    ("qwen3_30b_a3b", ParallelDims(world_size=128, tp=4, ep=32, etp=1), "FULL_SHARD"),
    ("deepseek_v3_style", ParallelDims(world_size=1024, tp=8, ep=64, etp=1), "NO_SHARD"),
    ("deepseek_v3_style", ParallelDims(world_size=1024, tp=8, ep=64, etp=1), "FULL_SHARD"),
]


@dataclass
class Row:
    """One layout's measured and computed bytes (``None``: not measured for this layout)."""

    local_params: int
    setup_peak: int
    step_peak: int | None
    save_transient: int | None
    megatron: float

    @property
    def params(self) -> int:
        """fp32 parameter bytes."""
        return 4 * self.local_params

    @property
    def state(self) -> int:
        """fp32 parameters, gradients and AdamW's two moments: 16 bytes per element."""
        return 4 * self.params


def megatron_weight_and_optimizer_bytes(config: MoETransformerConfig, dims: ParallelDims, distributed: bool) -> float:
    """Megatron-LM's ``report_theoretical_memory`` weight-and-optimizer bytes (module docstring),
    from the global parameter count: blocks / PP plus one embedding, all / TP, untied head added
    at PP=1."""
    with torch.device("meta"):
        model = MoETransformer(config)
    embedding = config.vocab_size * config.hidden_size
    total = sum(p.numel() for p in model.parameters())
    head = 0 if config.tie_embeddings else embedding
    blocks = total - embedding - head
    shard = (blocks / dims.pp + embedding) / dims.tp
    if head and dims.pp == 1:
        shard += head / dims.tp
    per_param = 6 + 12 / dims.dp if distributed else 18
    return shard * per_param


def measure_setup(name: str, dims: ParallelDims, sharding: str, rank: int) -> tuple[int, int]:
    """(local parameter elements, peak live bytes) of setting up ``rank`` of ``dims`` under FakeTensorMode."""
    with fake_rank(rank, dims.world_size):
        sharded = sharded_preset(name, dims, rank, sharding)
        with FakeTensorMode(allow_non_fake_inputs=True), LiveBytes() as setup:
            materialize(sharded.model, torch.device("cpu"))
        return sharded.local_parameters(), setup.peak


def measure_step_and_save(name: str, dims: ParallelDims) -> FakeRun:
    """Two optimizer steps (one micro-batch of `SEQ_LEN` tokens each; the second runs with the Adam
    moments) and a checkpoint save, on rank 0."""
    return run_fake_steps(name, dims, 0, SEQ_LEN, micro_batches=1, steps=2, save_checkpoint=True)


def measure(name: str, dims: ParallelDims, sharding: str) -> Row:
    """Every column of one layout (the step and the save: NO_SHARD only, the fake step's data parallelism)."""
    setups = [measure_setup(name, dims, sharding, rank) for rank in (0, dims.world_size - 1)]
    local, setup_peak = max(setups, key=lambda s: (s[1], s[0]))
    step_peak = save_transient = None
    if sharding == "NO_SHARD":
        run = measure_step_and_save(name, dims)
        step_peak = max(step.peak_bytes for step in run.steps)
        save_transient = run.save.peak_bytes - run.save.start_bytes
    megatron = megatron_weight_and_optimizer_bytes(load_preset(name), dims, distributed=sharding != "NO_SHARD")
    return Row(local, setup_peak, step_peak, save_transient, megatron)


def layout_name(dims: ParallelDims, sharding: str) -> str:
    """A short layout label."""
    parts = [f"W{dims.world_size}", f"TP{dims.tp}", f"EP{dims.ep}"]
    parts += [f"ETP{dims.etp}"] if dims.etp > 1 else []
    parts += [f"PP{dims.pp}"] if dims.pp > 1 else []
    return " ".join(parts) + ("" if sharding == "NO_SHARD" else f" {sharding}")


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="also write the table as markdown to this file")
    parser.add_argument("--quick", action="store_true", help="the first layout only")
    args = parser.parse_args(argv)
    layouts = LAYOUTS[:1] if args.quick else LAYOUTS
    header = ("| preset | layout | local params | params GiB | grads GiB | optimizer GiB | setup peak GiB "
              "| setup peak / params | step peak GiB | step transient GiB | save transient GiB "
              "| Megatron w+o GiB | ours w+o GiB |")
    lines = [
        f"### Per-rank bytes at scale (bf16-mixed, AdamW; fake process group, FakeTensorMode; "
        f"steps of one micro-batch of {SEQ_LEN} tokens)",
        "",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    print("\n".join(lines), flush=True)
    for name, dims, sharding in layouts:
        started = time.perf_counter()
        row = measure(name, dims, sharding)
        transient = None if row.step_peak is None else row.step_peak - row.state
        line = (
            f"| {name} | {layout_name(dims, sharding)} | {row.local_params / 1e9:.3f}B | {row.params / GIB:.2f} "
            f"| {row.params / GIB:.2f} | {2 * row.params / GIB:.2f} | {row.setup_peak / GIB:.2f} "
            f"| {row.setup_peak / row.params:.2f} | {_gib(row.step_peak)} | {_gib(transient)} "
            f"| {_gib(row.save_transient)} | {row.megatron / GIB:.2f} | {row.state / GIB:.2f} |"
        )
        lines.append(line)
        print(line, f"<!-- {time.perf_counter() - started:.1f} s -->", flush=True)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
