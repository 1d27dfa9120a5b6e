"""Plan the middle pipeline stages that hold the same blocks from two of them.

Under ``pipeline_parallel_size`` P with one stage per rank, the stages between the first (the
embedding) and the last (the head and the loss) often hold the same blocks: DeepSeek-V3 on 16
stages has 14 stages of MoE blocks only. Their planning runs (with `repeated_blocks`' cut, which
keeps one or two blocks of each repeated kind) then run the same model, and differ only in their
place in the schedule: under ``1F1B`` stage ``s`` holds the activations of ``P - s`` micro-batches at
its peak, under ``GPipe`` every stage holds all of them. What a stage holds is therefore a straight
line in ``s`` (its slope what one micro-batch keeps; zero under GPipe) for every byte count of the
step, each phase's peak and each kind of collective, and the stages of one signature
(`~lightning_moe.planning.repeated_blocks.stage_signatures`) are planned from the runs of two of
them:

    value(s) = value(a) + (s - a) * (value(b) - value(a)) / (b - a)

``plan(..., fast=True)`` asks for it, with the block cut; three or more middle stages of one
signature cost two stages' runs. It is exact on the layouts of ``tests/planning/test_stage_roles.py``
(every stage run as the oracle).
"""

from __future__ import annotations

import dataclasses

from lightning_moe.planning.fake_fit import RankStep

__all__ = ["interpolate_step", "interpolated_stages", "line"]


def interpolated_stages(signatures: list[tuple[tuple, dict[int, int]]], pp: int) -> dict[int, tuple[int, int]]:
    """``{stage: (a, b)}``: the middle stages planned from the runs of stages ``a`` and ``b`` (the first
    two of their signature, when it has three or more middle stages); every other stage runs."""
    groups: dict[tuple, list[int]] = {}
    for stage in range(1, pp - 1):
        groups.setdefault(signatures[stage][0], []).append(stage)
    return {stage: (members[0], members[1]) for members in groups.values() if len(members) >= 3
            for stage in members[2:]}


def line(value_a: float, value_b: float, a: int, b: int, s: int) -> int:
    """The value at ``s`` of the straight line through ``(a, value_a)`` and ``(b, value_b)``."""
    return round(value_a + (s - a) * (value_b - value_a) / (b - a))


def interpolate_step(step_a: RankStep, step_b: RankStep, a: int, b: int, s: int, *, rank: int,
                     held: dict[int, int]) -> RankStep:
    """Stage ``s``'s `RankStep` (of the same planning model as ``a``'s and ``b``'s runs: `line`
    for every number), for its first rank ``rank`` holding ``held`` blocks of each cut kind."""
    numbers = {name: line(getattr(step_a, name), getattr(step_b, name), a, b, s)
               for name in ("params_bytes", "grads_bytes", "optimizer_bytes", "start_bytes", "dispatch_bytes",
                            "host_reads")}
    phases = {phase: line(peak, step_b.phase_peaks[phase], a, b, s) for phase, peak in step_a.phase_peaks.items()}
    return dataclasses.replace(
        step_a, rank=rank, collectives=[], phase_peaks=phases, cut_blocks=dict(held),
        peak_bytes=max([numbers["start_bytes"], *phases.values()]), **numbers,
    )
