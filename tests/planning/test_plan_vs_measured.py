"""`lightning-moe plan` against a real CPU run of the same configuration.

The oracle is `helpers.step_memory.measure_fit`: the configuration trained for real on forked gloo
ranks, its second optimizer step measured with real tensors (`StepMemoryMeter`), routing exactly
balanced (`exactly_balanced_routing`: the routing the planner assumes at ``imbalance=1``). The
planner runs the same configuration on fake tensors as one rank of a fake world. Parameter,
gradient and optimizer bytes must be equal; activation and peak bytes within 10%, per pipeline
stage (the largest rank of the stage in the real run).
"""

from __future__ import annotations

import functools
import os

import pytest
from helpers.step_memory import TINY_LAYOUTS, measure_fit

from lightning_moe.parallel import ParallelDims
from lightning_moe.planning import plan

pytestmark = pytest.mark.distributed

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "tiny_cpu.yaml")
WORLD = 4
LAYOUTS = TINY_LAYOUTS
EXACT = ("params_bytes", "grads_bytes", "optimizer_bytes")
WITHIN_10_PERCENT = ("activation_bytes", "peak_bytes")


@functools.cache
def _planned_and_measured(name: str):
    args = ["--config", CONFIG, *LAYOUTS[name]]
    # Two processes plan the stages (a pipeline layout exchanges boundary shapes between them).
    return plan(args, jobs=2), measure_fit(args, WORLD, balanced_routing=True)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_plan_equals_a_real_run(name):
    planned, measured = _planned_and_measured(name)
    _assert_equal(name, planned, measured)
    # The largest rank of the plan is the largest stage's.
    assert planned.largest.step.peak_bytes == max(s.step.peak_bytes for s in planned.stages)


def _assert_equal(name: str, planned, measured) -> None:
    """Every stage's plan against the stage's largest rank in the real run."""
    dims: ParallelDims = planned.dims
    assert len(planned.stages) == dims.pp
    for stage in planned.stages:
        ranks = [r for r in range(WORLD) if dims.coords(r).pp == stage.stage]
        real = max((measured[r] for r in ranks), key=lambda m: m["peak_bytes"])
        want = stage.bytes()
        for key in EXACT:
            assert want[key] == real[key], (name, stage.stage, key, want[key], real[key])
        for key in WITHIN_10_PERCENT:
            ratio = want[key] / real[key]
            assert 0.9 <= ratio <= 1.1, (name, stage.stage, key, want[key], real[key], ratio)


_S = "--trainer.strategy.init_args."
PP_FULL_SHARD = [f"{_S}pipeline_parallel_size=2", f"{_S}num_microbatches=2", f"{_S}expert_parallel_size=1",
                 f"{_S}sharding_strategy=FULL_SHARD"]
MESHES_BUILT_IN_SETUP = {
    "cp2-pp2-full-shard": [*PP_FULL_SHARD, f"{_S}context_parallel_size=2", f"{_S}tensor_parallel_size=1"],
    "tp2-pp2-full-shard": [*PP_FULL_SHARD, f"{_S}tensor_parallel_size=2"],
}


@pytest.mark.parametrize("name", sorted(MESHES_BUILT_IN_SETUP))
def test_plan_equals_a_real_run_where_setup_builds_device_meshes(name):
    """FSDP2 builds device meshes while a pipeline stage is sharded, on fake tensors in the plan: the
    flattened ``dp`` x ``cp`` mesh, and the ``dp`` + ``tp`` mesh of a tensor-parallel parameter
    (``plan --search`` meets both layouts in every world of 4 or more ranks)."""
    args = ["--config", CONFIG, *MESHES_BUILT_IN_SETUP[name]]
    _assert_equal(name, plan(args, jobs=2), measure_fit(args, WORLD, balanced_routing=True))
