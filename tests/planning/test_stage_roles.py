"""Pipeline stages planned from runs with fewer micro-batches equal each stage run with all of them.

The oracle is the planner's run of every stage with every micro-batch (``plan(args)``), checked
against real runs in ``test_plan_vs_measured.py``. Five stages of one MoE block each and six
micro-batches: under 1F1B stage ``s`` has ``5 - s`` in flight at its first backward, then pairs of
one backward and one forward; under GPipe all six are in flight. ``fast`` runs each planned stage
once, measuring one step per micro-batch cut (`planning_cuts`), and draws stages 2 and 3, which
hold stage 1's blocks, from stage 1's run; under 1F1B the last stage is cut with one in flight.
"""

from __future__ import annotations

import copy
import os

import pytest
from helpers.step_memory import TINY_LAYOUTS

from lightning_moe.planning import plan, planner
from lightning_moe.planning.microbatch_cut import MicrobatchCut, planning_cuts, schedule_shape
from lightning_moe.planning.stage_roles import shared_stages

pytestmark = pytest.mark.distributed

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "tiny_cpu.yaml")
_S = "--trainer.strategy.init_args."
FIVE_STAGES = [*TINY_LAYOUTS["pp2-ep2"], "--trainer.devices=10", f"{_S}pipeline_parallel_size=5",
               f"{_S}num_microbatches=6", "--data.batch_size=6", "--model.model.num_layers=5"]


@pytest.fixture
def runs_counted(monkeypatch):
    """Each planning run runs once per test (the exact plan's runs are the fast plan's without a
    micro-batch cut), and the runs are listed as (rank, the micro-batch cuts of its measured steps)."""
    real, done, ran = planner.fake_fit_steps, {}, []

    def cached(args, rank, world_size, *, cut=None, objects, microbatches=None, **kwargs):
        key = rank, microbatches
        if key not in done:
            steps = real(args, rank, world_size, cut=cut, objects=objects, microbatches=microbatches, **kwargs)
            done[key] = steps, dict(objects.sent)  # with what it sent (also in a try that waited)
            ran.append(key)
            assert not any(step.cut_blocks for step in steps)
        steps, sent = done[key]
        objects.sent.update(sent)  # what its run sent, for the stages that wait for it
        return copy.deepcopy(steps)

    monkeypatch.setattr(planner, "fake_fit_steps", cached)
    return ran


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_stages_drawn_from_fewer_microbatches_equal_their_runs_with_all(schedule, runs_counted):
    args = ["--config", CONFIG, *FIVE_STAGES, f"{_S}pipeline_schedule={schedule}"]
    fast = plan(args, jobs=1, fast=True)
    stage_of = {s.step.rank: s.stage for s in fast.stages}
    ran = {(stage_of[r], cuts and tuple((cut.warmup, cut.count) for cut in cuts)) for r, cuts in runs_counted}
    if schedule == "1F1B":  # one run per stage measures both of its cuts, one step each
        assert ran == {(0, ((2, 3), (3, 4))), (1, ((2, 3), (3, 4))), (4, ((1, 2), (1, 3)))}, ran
    else:
        assert ran == {(0, ((2, 2), (3, 3))), (1, ((2, 2), (3, 3))), (4, ((2, 2), (3, 3)))}, ran
    fast_runs = len(runs_counted)
    assert fast_runs == len(ran), "stages 2 and 3 must be drawn from stage 1's runs"
    exact = plan(args, jobs=1)
    assert all(cut is None for _, cut in runs_counted[fast_runs:])
    assert {stage_of[r] for r, cut in runs_counted if cut is None} == set(range(5))
    for a, b in zip(fast.stages, exact.stages, strict=True):
        assert (a.stage, a.step.rank) == (b.stage, b.step.rank)
        assert a.bytes() == b.bytes(), a.stage
        assert a.communication == b.communication, a.stage
        assert a.step.phase_peaks == b.step.phase_peaks, a.stage
        assert a.step.host_reads == b.step.host_reads, a.stage
    peaks = [s.step.peak_bytes for s in exact.stages[1:4]]
    if schedule == "1F1B":  # stage s keeps 5 - s micro-batches in flight
        assert peaks[0] > peaks[1] > peaks[2]
    else:  # every stage keeps all six
        assert peaks[0] == peaks[1] == peaks[2]


def test_the_runs_a_stage_is_planned_from():
    cut = MicrobatchCut
    # 1F1B, 4 stages, 8 micro-batches: in flight 4, 3, 2, 1, all with pairs of backward and forward.
    assert [schedule_shape("1F1B", 8, 4, s) for s in range(4)] == [(4, 8), (3, 8), (2, 8), (1, 8)]
    assert planning_cuts("1F1B", 8, 4, 0) == (cut(2, 3), cut(3, 4))
    assert planning_cuts("1F1B", 8, 4, 3) == (cut(1, 2), cut(1, 3))  # one in flight: vary the count only
    # DeepSeek-V3 on 16 stages of 16 micro-batches: stage 0 runs its 16 forwards first.
    assert planning_cuts("1F1B", 16, 16, 0) == (cut(2, 2), cut(3, 3))
    assert planning_cuts("GPipe", 8, 4, 2) == (cut(2, 2), cut(3, 3))
    # A run of both cuts (after one warm-up micro-batch) runs 1 + 3 + 4 micro-batches, a stage run
    # whole 2 M (a warm-up step and the measured one, all M in each): cut where that is fewer.
    assert planning_cuts("1F1B", 5, 4, 1) == (cut(2, 3), cut(3, 4)) and planning_cuts("1F1B", 5, 5, 0) == (cut(2, 2), cut(3, 3))
    assert planning_cuts("1F1B", 3, 4, 1) is None and planning_cuts("1F1B", 3, 5, 1) is None
    # ... unless the runs serve more stages: three middle stages of 3 micro-batches.
    assert planning_cuts("1F1B", 3, 5, 1, serves=3) == (cut(2, 2), cut(3, 3))
    assert planning_cuts("Interleaved1F1B", 16, 4, 0) is None


def test_middle_stages_of_one_signature_and_cuts_share_runs():
    moe, dense = (("moe",), ()), (("dense",), ())
    signatures = [(dense, {}), (moe, {}), (moe, {}), (dense, {}), (moe, {}), (moe, {})]
    cuts = {1: "a", 2: "a", 3: "a", 4: "b"}.get
    # Stage 2 holds stage 1's blocks with the same cuts; 4 others; 3 other blocks; 5 is the last stage.
    assert shared_stages(signatures, 6, cuts) == {2: 1}
    assert shared_stages(signatures, 6, lambda stage: None) == {}


def test_stages_cut_under_fsdp2_and_recompute_equal_their_runs_with_all():
    """A run grows its stage's receive buffers between its two measured steps: made as the step
    makes them (fake, counted), the second step holds what a run of its cut alone would."""
    three_stages = [*TINY_LAYOUTS["pp2-ep2"], "--trainer.devices=6", f"{_S}pipeline_parallel_size=3",
                    f"{_S}num_microbatches=6", "--data.batch_size=6", "--model.model.num_layers=3",
                    f"{_S}sharding_strategy=FULL_SHARD", "--trainer.callbacks+=lightning_moe.callbacks.SelectiveRecompute",
                    "--trainer.callbacks.modules=[attention,moe]"]
    args = ["--config", CONFIG, *three_stages]
    fast, exact = plan(args, jobs=2, fast=True), plan(args, jobs=2)
    for a, b in zip(fast.stages, exact.stages, strict=True):
        assert a.bytes() == b.bytes(), a.stage
        assert a.step.phase_peaks == b.step.phase_peaks, a.stage
        assert a.communication == b.communication, a.stage
