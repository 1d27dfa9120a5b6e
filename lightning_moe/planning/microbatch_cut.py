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

``plan(..., fast=True)`` therefore measures a stage's steps with ``m`` micro-batches of which ``w``
are in flight: ``(w, m) = (2, 2 + k)`` and ``(3, 3 + k)``, where ``k = 1`` when the stage's schedule has
pairs of one backward and one forward (``M > W``) and 0 otherwise, so that the runs have the
schedule's phases (a stage with one in flight: ``(1, 1 + k)`` and ``(1, 2 + k)``; see
`planning_cuts`). With ``lo`` and ``hi`` those steps' values:

    count(M) = lo + (M - m_lo) * (hi - lo)
    peak(W, M) = lo + (W - w_lo) * (hi - lo - c) + (M - m_lo) * c,    c = hi.start - lo.start

(with one in flight in both steps, a peak is a count: what the last stage keeps per micro-batch of the
step beyond its start, the losses and their weights, is then measured too).

One run measures both steps, after a step of one micro-batch (`WARMUP_CUT`: it leaves what any
step leaves, the optimizer moments, the gradients, the receive buffers); between the steps the
stage's receive buffers grow to the next step's count, so each step starts holding what a run of
its cut alone would (`microbatches_cut`). The steps keep the schedule torch runs; only the number
of micro-batches fed to it and its warmup are set. The run of a middle stage serves every middle
stage holding the same blocks, whatever its ``W``; stages are cut only where that saves work. It is
exact on the layouts of ``tests/planning/test_stage_roles.py`` (every stage run whole as the oracle).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from lightning_moe.compat import set_schedule_microbatches, unset_fake_temporarily
from lightning_moe.planning.rank_step import LINEAR_FIELDS, RankStep

__all__ = ["CUT_SCHEDULES", "WARMUP_CUT", "MicrobatchCut", "draw", "microbatches_cut", "planning_cuts", "schedule_shape"]

CUT_SCHEDULES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}
"""The schedules (with one stage per rank) whose steps are planned from fewer micro-batches."""


@dataclass(frozen=True)
class MicrobatchCut:
    """A planning run's schedule: ``count`` micro-batches per step, ``warmup`` of them in flight
    before the first backward (``1F1B``; ``GPipe`` runs them all first)."""

    warmup: int
    count: int


WARMUP_CUT = MicrobatchCut(1, 1)
"""What the unmeasured steps before the measured ones run (`microbatches_cut`): they exist only to
leave behind what a step leaves (optimizer moments, gradients, receive buffers), one micro-batch
does that."""


def schedule_shape(schedule: str, num_microbatches: int, pp: int, stage: int) -> tuple[int, int]:
    """``(W, M)`` of ``stage``: the micro-batches in flight at its first backward, and per step."""
    if schedule == "GPipe":
        return num_microbatches, num_microbatches
    return min(num_microbatches, pp - stage), num_microbatches


def planning_cuts(schedule: str, num_microbatches: int, pp: int, stage: int,
                  serves: int = 1) -> tuple[MicrobatchCut, MicrobatchCut] | None:
    """The two steps ``stage`` is planned from, or None where their run would run as many
    micro-batches as the ``serves`` stages it plans run whole (or the schedule is not one of
    `CUT_SCHEDULES`).

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
    # One run measures both, after a step of `WARMUP_CUT`; a stage run whole warms up with all.
    return (lo, hi) if WARMUP_CUT.count + lo.count + hi.count < 2 * count * serves else None


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


def _cut_schedule(cls, current: list[MicrobatchCut]):
    def make(stage, n_microbatches, **kwargs):
        cut = current[0]
        # torch refuses fewer micro-batches than stages (1F1B): built for enough, then told how many.
        schedule = cls(stage, max(n_microbatches, stage.num_stages), **kwargs)
        set_schedule_microbatches(schedule, cut.count, cut.warmup if cls is Schedule1F1B else None)
        return schedule

    return make


def _resized(runner, old: MicrobatchCut, new: MicrobatchCut) -> None:
    """The runner's training schedules run ``new`` from the next step on: their stages' receive
    buffers grown to its count, each schedule found under the shape of its batches."""
    runner.num_microbatches = new.count
    for key in [key for key in runner._schedules if key[2]]:  # (batch shape, dtype, training)
        schedule = runner._schedules.pop(key)
        set_schedule_microbatches(schedule, new.count, new.warmup if isinstance(schedule, Schedule1F1B) else None)
        shape = (key[0][0] // old.count * new.count, *key[0][1:])
        runner._schedules[(shape, *key[1:])] = schedule


@contextmanager
def microbatches_cut(cuts: Sequence[MicrobatchCut] | MicrobatchCut | None,
                     measure_step: int = 1) -> Iterator[Callable[[int], None]]:
    """Training steps of a `~lightning_moe.parallel.pipeline.runner.PipelineRunner` run the first
    ``cut.count`` micro-batches of each batch, ``cut.warmup`` in flight (None: as configured).

    ``cuts``: one per optimizer step from ``measure_step`` on (more micro-batches each, or as many),
    the steps before run `WARMUP_CUT`. Yields ``to_step(global_step)``: call it between optimizer
    steps, before the next one starts, under the fake mode the steps run in; where the next step's
    cut differs, the schedule's receive buffers grow to it then, so that the step starts holding
    what a run of its cut from the first step would hold."""
    if cuts is None:
        yield lambda global_step: None
        return
    from lightning_moe.parallel.pipeline import runner as pipeline_runner

    cuts = (cuts,) if isinstance(cuts, MicrobatchCut) else tuple(cuts)

    def cut_at(global_step: int) -> MicrobatchCut:
        if global_step < measure_step:
            return WARMUP_CUT
        return cuts[min(global_step - measure_step, len(cuts) - 1)]

    current, runners = [cut_at(0)], []
    real_step = pipeline_runner.PipelineRunner.step

    def step(self, inputs, targets, grad_sync=None):
        cut = current[0]
        if self not in runners:
            runners.append(self)
        configured = self.__dict__.setdefault("_configured_microbatches", self.num_microbatches)
        size = inputs.shape[0] // configured * cut.count
        self.num_microbatches = cut.count
        if self._weighted_loss is not None:
            self._weighted_loss.num_microbatches = cut.count
        with unset_fake_temporarily():  # a view of the batch as it came (a host batch stays one)
            inputs, targets = inputs[:size], targets[:size]
        return real_step(self, inputs, targets, grad_sync)

    def to_step(global_step: int) -> None:
        cut = cut_at(global_step)
        if cut != current[0]:
            for runner in runners:
                _resized(runner, current[0], cut)
            current[0] = cut

    schedules = {name: (_cut_schedule(cls, current), *pipeline_runner.PIPELINE_SCHEDULES[name][1:])
                 for name, cls in CUT_SCHEDULES.items()}
    with mock.patch.object(pipeline_runner.PipelineRunner, "step", step), \
            mock.patch.dict(pipeline_runner.PIPELINE_SCHEDULES, schedules):
        yield to_step
