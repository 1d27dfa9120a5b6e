"""Middle pipeline stages of one signature planned from two of them equal each run on its own.

The oracle is the planner's run of the stage itself (``plan(args)`` runs every stage), checked
against real runs in ``test_plan_vs_measured.py``. Five stages of one MoE block each: the three
middle stages hold the same blocks, so ``fast`` runs stages 1 and 2 and draws stage 3 on their line
(under 1F1B stage ``s`` keeps ``P - s`` micro-batches at its peak; under GPipe all of them).
"""

from __future__ import annotations

import copy
import os

import pytest
from helpers.step_memory import TINY_LAYOUTS

from lightning_moe.planning import plan, planner
from lightning_moe.planning.stage_roles import interpolated_stages, line

pytestmark = pytest.mark.distributed

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "tiny_cpu.yaml")
_S = "--trainer.strategy.init_args."
FIVE_STAGES = [*TINY_LAYOUTS["pp2-ep2"], "--trainer.devices=10", f"{_S}pipeline_parallel_size=5",
               f"{_S}num_microbatches=5", "--data.batch_size=5", "--model.model.num_layers=5"]


@pytest.fixture
def runs_counted(monkeypatch):
    """Each rank's fake step runs once per test (no block is cut here, so the fast plan's runs are the
    exact plan's), and the ranks that ran are listed."""
    real, done, ran = planner.fake_fit_rank, {}, []

    def cached(args, rank, world_size, *, cut=None, objects, **kwargs):
        if rank not in done:
            step = real(args, rank, world_size, cut=cut, objects=objects, **kwargs)  # may raise AwaitsObject
            done[rank] = step, dict(objects.sent)  # with what it sent (also in a try that waited)
            ran.append(rank)
            assert not step.cut_blocks
        step, sent = done[rank]
        objects.sent.update(sent)  # what its run sent, for the stages that wait for it
        return copy.deepcopy(step)

    monkeypatch.setattr(planner, "fake_fit_rank", cached)
    return ran


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_a_middle_stage_drawn_from_two_equals_its_own_run(schedule, runs_counted):
    args = ["--config", CONFIG, *FIVE_STAGES, f"{_S}pipeline_schedule={schedule}"]
    fast = plan(args, jobs=1, fast=True)
    stage_of = {s.step.rank: s.stage for s in fast.stages}
    assert sorted(stage_of[r] for r in runs_counted) == [0, 1, 2, 4], "stage 3 must be drawn, not run"
    exact = plan(args, jobs=1)
    assert sorted(stage_of[r] for r in runs_counted) == [0, 1, 2, 3, 4]
    for a, b in zip(fast.stages, exact.stages, strict=True):
        assert (a.stage, a.step.rank) == (b.stage, b.step.rank)
        assert a.bytes() == b.bytes(), a.stage
        assert a.communication == b.communication, a.stage
        assert a.step.phase_peaks == b.step.phase_peaks, a.stage
    peaks = [s.step.peak_bytes for s in exact.stages[1:4]]
    if schedule == "1F1B":  # stage s keeps P - s micro-batches: the line falls
        assert peaks[0] > peaks[1] > peaks[2]
    else:  # every stage keeps all five
        assert peaks[0] == peaks[1] == peaks[2]


def test_only_three_or_more_middle_stages_of_one_signature_share_runs():
    moe, dense = (("moe",), ()), (("dense",), ())
    # Stages 0 and 5 are the ends; 1-4 alternate two signatures of two stages each: nothing shared.
    assert interpolated_stages([(dense, {}), (moe, {}), (dense, {}), (moe, {}), (dense, {}), (moe, {})], 6) == {}
    signatures = [(dense, {}), *[(moe, {0: 4})] * 4, (moe, {0: 3}), (moe, {})]
    assert interpolated_stages(signatures, 7) == {3: (1, 2), 4: (1, 2), 5: (1, 2)}
    assert line(10, 7, 1, 2, 5) == -2 and line(4, 4, 1, 2, 9) == 4
