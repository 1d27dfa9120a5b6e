"""`lightning-moe plan` against a real CPU run of the same configuration, per pipeline stage.

For four layouts of ``examples/configs/tiny_cpu.yaml`` on a world of 4 (TP=2 x EP=4 as
configured; PP=2 x EP=2 with 2 micro-batches; CP=2 x EP=2; FULL_SHARD x EP=4), two numbers of
each of five quantities of the second optimizer step (the first that runs with AdamW's moments):

* planned: ``lightning_moe.planning.plan`` (what ``lightning-moe plan`` prints): the
  configuration's real setup and training step run on fake tensors as the first rank of every
  pipeline stage of a fake world, in this process, routing taken perfectly balanced;
* measured: ``tests/helpers/step_memory.measure_fit``: the same configuration trained for real on
  4 forked gloo ranks, routing exactly balanced (the routers' ``force_load_balancing``, patched to
  send every expert the same rows: what the plan assumes), the step measured by
  ``StepMemoryMeter`` with real tensors. Per stage and per quantity, the largest of the stage's
  ranks.

The quantities (bytes of distinct tensor storages on the rank; definitions in
``tests/helpers/step_memory.py``): ``params`` (the local shards), ``grads`` (before the update; a
gradient-sync bucket counts whole), ``optimizer`` (AdamW's moments and step counters), ``peak``
(the largest live bytes from the step's first micro-batch to its last, everything held included)
and ``activations`` := peak - params - grads - optimizer (activations, temporaries and buffers at
the peak). ``ratio`` = planned / measured. Also printed, on a layout's first row: the wall time of
its plan (every stage) and of its real run (four ranks on this machine's cores, start-up, data
and two steps included).

What neither side sees: memory an op uses inside and frees before returning (kernel workspaces),
a collective's internal buffers, allocator caching and fragmentation. Both run on the CPU: the
GPU's kernels are compared by ``benchmarks/plan_gpu_check.py`` (``benchmarks/gpu_check.sh``).

    python benchmarks/plan_vs_measured.py                        # about 2 minutes on 2 cores
    python benchmarks/plan_vs_measured.py --output plan.md       # also as markdown
    python benchmarks/plan_vs_measured.py --layouts tp2-ep4      # one layout
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))  # the harness

from helpers.step_memory import TINY_LAYOUTS, measure_fit

from lightning_moe.planning import plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
WORLD = 4
LAYOUTS = TINY_LAYOUTS

KEYS = (("params_bytes", "params"), ("grads_bytes", "grads"), ("optimizer_bytes", "optimizer"),
        ("activation_bytes", "activations"), ("peak_bytes", "peak"))


def compare(name: str) -> list[str]:
    """The table rows of one layout: per pipeline stage, every quantity planned, measured and their ratio."""
    args = ["--config", CONFIG, *LAYOUTS[name]]
    started = time.perf_counter()
    planned = plan(args)
    plan_s = time.perf_counter() - started
    started = time.perf_counter()
    measured = measure_fit(args, WORLD, balanced_routing=True)
    real_s = time.perf_counter() - started
    rows = []
    for stage in planned.stages:
        ranks = [r for r in range(WORLD) if planned.dims.coords(r).pp == stage.stage]
        want = stage.bytes()
        cells = [name, str(stage.stage)]
        for key, _ in KEYS:
            real = max(measured[r][key] for r in ranks)
            cells += [f"{want[key] / 1024:.1f}", f"{real / 1024:.1f}", f"{want[key] / real:.3f}"]
        first = stage is planned.stages[0]  # one plan and one real run per layout: their times once
        cells += [f"{plan_s:.1f}", f"{real_s:.1f}"] if first else ["", ""]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="also write the table as markdown to this file")
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS),
                        help="the layouts to compare (default: all four)")
    args = parser.parse_args(argv)
    # Lightning's start-up lines and warnings describe the runs' set-up, not the table (as `lightning-moe plan`).
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.simplefilter("ignore")
    header = ["layout", "stage"]
    for _, label in KEYS:
        header += [f"{label} planned KiB", f"{label} measured KiB", f"{label} ratio"]
    header += ["plan s", "real run s"]
    lines = [
        f"### Planned vs measured bytes of the second optimizer step: tiny_cpu.yaml on {WORLD} ranks "
        "(KiB; measured: the largest rank of the stage; ratio = planned / measured)",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    print("\n".join(lines), flush=True)
    for name in args.layouts:
        rows = compare(name)
        lines += rows
        print("\n".join(rows), flush=True)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
