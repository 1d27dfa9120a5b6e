"""How long ``lightning-moe plan --fast`` takes with and without the micro-batch cut, in one run.

Plans one configuration twice in this process, as ``plan(args, fast=True)``: once as it is (each
pipeline stage drawn from one run measuring steps with two and three micro-batches in flight, the
middle stages that hold the same blocks from one stage's run: ``lightning_moe.planning.microbatch_cut``), once with
the cut switched off (every stage run with all its micro-batches). Prints both wall times, their
ratio, the planning runs each finished, and whether the two plans hold the same bytes on every
stage (parameters, gradients, optimizer states, activations, peak, each phase's peak, bytes sent
per kind of collective).

    python benchmarks/plan_speed.py                       # DeepSeek-V3 on 1024 GPUs: about 10 minutes on 2 cores
    python benchmarks/plan_speed.py --config examples/configs/plan/deepseek_v3_256gpu.yaml
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from unittest import mock

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEFAULT_CONFIG = os.path.join(ROOT, "examples", "configs", "plan", "deepseek_v3_1024gpu.yaml")


def _timed_plan(args: list[str], cut: bool) -> tuple[float, int, object]:
    from lightning_moe.planning import planner

    finished = []
    real = planner.run_ranks

    def counted(keys, *a, **kw):
        done = real(keys, *a, **kw)
        finished.extend(done)  # the runs that finished (a run waiting for another stage's object ran again)
        return done

    patches = [mock.patch.object(planner, "run_ranks", counted)]
    if not cut:
        patches.append(mock.patch.object(planner, "_microbatch_cuts", lambda layout, stage, serves=1: None))
    for patch in patches:
        patch.start()
    try:
        start = time.perf_counter()
        result = planner.plan(args, fast=True)
        return time.perf_counter() - start, len(finished), result
    finally:
        for patch in reversed(patches):
            patch.stop()


def _stage_numbers(stage) -> tuple:
    return stage.bytes(), stage.step.phase_peaks, stage.communication


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="a `lightning-moe fit` configuration with PP")
    options = parser.parse_args(argv)
    args = ["--config", options.config]
    cut_time, cut_runs, with_cut = _timed_plan(args, cut=True)
    whole_time, whole_runs, without = _timed_plan(args, cut=False)
    differing = [a.stage for a, b in zip(with_cut.stages, without.stages, strict=True)
                 if _stage_numbers(a) != _stage_numbers(b)]
    print(f"config: {os.path.relpath(options.config)} ({with_cut.dims.world_size} ranks, PP {with_cut.dims.pp})")
    print(f"plan --fast with the micro-batch cut:    {cut_time:7.1f} s, {cut_runs} planning runs finished")
    print(f"plan --fast, every micro-batch run:      {whole_time:7.1f} s, {whole_runs} planning runs finished")
    print(f"speed-up: {whole_time / cut_time:.2f}x")
    print("every stage's bytes equal" if not differing else f"stages whose bytes differ: {differing}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
