"""Plan a pipeline stage's step from runs with two and three micro-batches in flight.

Under pipeline parallelism every stage runs all ``M`` micro-batches of a step, and a fake step costs
the same for each: sixteen micro-batches of a DeepSeek-V3 stage take a minute. But the schedule
repeats itself. Under ``1F1B`` stage ``s`` runs ``W = min(M, P - s)`` forwards (its warmup), then
``M - W`` pairs of one backward and one forward, then its last ``W`` backwards; under ``GPipe`` all
``M`` forwards, then all backwards (``W = M``). So a step's numbers are straight lines:

* what it sends and reads, and what it holds at its start, grow with ``M``: every micro-batch
  sends the same, and the stage keeps the same (its receive buffers) for each;
* each phase's peak grows by ``c`` per micro-batch of the step (``c``: the start's growth) and by
  what one micro-batch keeps for backward per micro-batch in flight (``W``).

``plan(..., fast=True)`` therefore runs a stage with ``m`` micro-batches of which ``w`` are in
flight: ``(w, m) = (2, 2 + k)`` and ``(3, 3 + k)``, where ``k = 1`` when the stage's schedule has
pairs of one backward and one forward (``M > W``) and 0 otherwise, so that the runs have the
schedule's phases (a stage with one in flight: ``(1, 1 + k)`` and ``(1, 2 + k)``; see
`planning_cuts`). With ``lo`` and ``hi`` those runs' values:

    count(M) = lo + (M - m_lo) * (hi - lo)
    peak(W, M) = lo + (W - w_lo) * (hi - lo - c) + (M - m_lo) * c,    c = hi.start - lo.start

(with one in flight in both runs, a peak is a count: what the last stage keeps per micro-batch of the
step beyond its start, the losses and their weights, is then measured too).

The runs keep the schedule torch runs; only the number of micro-batches fed to it and its
warmup are set (`microbatches_cut`). The runs of a middle stage serve every middle stage holding
the same blocks, whatever its ``W``; stages are cut only where that saves work (the two runs
together run fewer micro-batches than the stages they serve run whole). It is
exact on the layouts of ``tests/planning/test_stage_roles.py`` (every stage run whole as the oracle).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from lightning_moe.compat import set_schedule_microbatches, unset_fake_temporarily
from lightning_moe.planning.rank_step import LINEAR_FIELDS, RankStep

__all__ = ["CUT_SCHEDULES", "MicrobatchCut", "draw", "microbatches_cut", "planning_cuts", "schedule_shape"]

CUT_SCHEDULES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}
"""The schedules (with one stage per rank) whose steps are planned from fewer micro-batches."""


@dataclass(frozen=True)
class MicrobatchCut:
    """A planning run's schedule: ``count`` micro-batches per step, ``warmup`` of them in flight
    before the first backward (``1F1B``; ``GPipe`` runs them all first)."""

    warmup: int
    count: int


def schedule_shape(schedule: str, num_microbatches: int, pp: int, stage: int) -> tuple[int, int]:
    """``(W, M)`` of ``stage``: the micro-batches in flight at its first backward, and per step."""
    if schedule == "GPipe":
        return num_microbatches, num_microbatches
    return min(num_microbatches, pp - stage), num_microbatches


def planning_cuts(schedule: str, num_microbatches: int, pp: int, stage: int,
                  serves: int = 1) -> tuple[MicrobatchCut, MicrobatchCut] | None:
    """The two runs ``stage`` is planned from, or None where they would run as many micro-batches as
    the ``serves`` stages they plan run whole (or the schedule is not one of `CUT_SCHEDULES`).

    With one micro-batch in flight a stage is not on the line that two, three and more draw (the
    tested 1F1B stages peak 16 KiB above it there), so the runs have two and three in flight; a stage
    with one in flight (the last under ``1F1B``) runs with one and differs in the micro-batches per
    step only."""
    if schedule not in CUT_SCHEDULES:
        return None
    in_flight, count = schedule_shape(schedule, num_microbatches, pp, stage)
    steady = int(count > in_flight)
    if in_flight == 1:
        lo, hi = MicrobatchCut(1, 1 + steady), MicrobatchCut(1, 2 + steady)
    else:
        lo, hi = MicrobatchCut(2, 2 + steady), MicrobatchCut(3, 3 + steady)
    return (lo, hi) if lo.count + hi.count < count * serves else None


def draw(lo: tuple[RankStep, dict[str, int]], hi: tuple[RankStep, dict[str, int]], cuts: tuple[MicrobatchCut, MicrobatchCut],
         shape: tuple[int, int], *, rank: int, held: dict[int, int]) -> tuple[RankStep, dict[str, int]]:
    """The step (and bytes sent per kind) of a stage whose schedule has ``shape`` = ``(W, M)``, from
    its runs ``lo`` and ``hi`` cut as ``cuts`` (`planning_cuts`: ``hi`` one micro-batch more, and one
    more in flight or as many), for its first rank ``rank`` holding ``held`` blocks of each cut kind."""
    (lo_step, lo_sent), (hi_step, hi_sent) = lo, hi
    lo_cut, hi_cut = cuts
    in_flight, count = shape
    more = count - lo_cut.count
    deepened = hi_cut.warmup > lo_cut.warmup
    deeper = in_flight - lo_cut.warmup if deepened else 0
    kept = hi_step.start_bytes - lo_step.start_bytes  # what the stage keeps per micro-batch of the step

    def counted(a: int, b: int) -> int:
        return a + more * (b - a)

    def peak(a: int, b: int) -> int:
        if not deepened:  # the runs differ in the micro-batches per step only
            return counted(a, b)
        return a + deeper * (b - a - kept) + more * kept

    numbers = {name: counted(getattr(lo_step, name), getattr(hi_step, name)) for name in LINEAR_FIELDS}
    phases = {phase: peak(value, hi_step.phase_peaks.get(phase, value)) for phase, value in lo_step.phase_peaks.items()}
    step = dataclasses.replace(
        lo_step, rank=rank, collectives=[], phase_peaks=phases, cut_blocks=dict(held),
        # The dispatchers' buffers at the peak: those of each micro-batch in flight.
        dispatch_bytes=lo_step.dispatch_bytes + deeper * (hi_step.dispatch_bytes - lo_step.dispatch_bytes),
        peak_bytes=max([numbers["start_bytes"], *phases.values()]), **numbers,
    )
    return step, {kind: counted(lo_sent[kind], hi_sent[kind]) for kind in lo_sent}


def _cut_schedule(cls, cut: MicrobatchCut):
    def make(stage, n_microbatches, **kwargs):
        # torch refuses fewer micro-batches than stages (1F1B): built for enough, then told how many.
        schedule = cls(stage, max(n_microbatches, stage.num_stages), **kwargs)
        set_schedule_microbatches(schedule, n_microbatches, cut.warmup if cls is Schedule1F1B else None)
        return schedule

    return make


@contextmanager
def microbatches_cut(cut: MicrobatchCut | None) -> Iterator[None]:
    """Training steps of a `~lightning_moe.parallel.pipeline.runner.PipelineRunner` run the first
    ``cut.count`` micro-batches of each batch, ``cut.warmup`` in flight (None: as configured)."""
    if cut is None:
        yield
        return
    from lightning_moe.parallel.pipeline import runner as pipeline_runner

    real_step = pipeline_runner.PipelineRunner.step

    def step(self, inputs, targets, grad_sync=None):
        configured = self.__dict__.setdefault("_configured_microbatches", self.num_microbatches)
        size = inputs.shape[0] // configured * cut.count
        self.num_microbatches = cut.count
        if self._weighted_loss is not None:
            self._weighted_loss.num_microbatches = cut.count
        with unset_fake_temporarily():  # a view of the batch as it came (a host batch stays one)
            inputs, targets = inputs[:size], targets[:size]
        return real_step(self, inputs, targets, grad_sync)

    schedules = {name: (_cut_schedule(cls, cut), *pipeline_runner.PIPELINE_SCHEDULES[name][1:])
                 for name, cls in CUT_SCHEDULES.items()}
    with mock.patch.object(pipeline_runner.PipelineRunner, "step", step), \
            mock.patch.dict(pipeline_runner.PIPELINE_SCHEDULES, schedules):
        yield
