"""Middle pipeline stages that hold the same blocks share their planning runs.

Under ``pipeline_parallel_size`` P with one stage per rank, the stages between the first (the
embedding) and the last (the head and the loss) often hold the same blocks: DeepSeek-V3 on 16
stages has 14 stages of MoE blocks only. Their planning runs (with `repeated_blocks`' cut, which
keeps one or two blocks of each repeated kind) then run the same model, and differ only in their
place in the schedule: under ``1F1B`` stage ``s`` has ``P - s`` micro-batches in flight at its first
backward. Planned from runs with fewer micro-batches (`microbatch_cut`), whose number in flight is
set, the runs of one such stage are every other's: each stage's step is drawn from them at its
own place (`microbatch_cut.draw`). ``plan(..., fast=True)`` asks for it; the stages of one
signature (`~lightning_moe.planning.repeated_blocks.stage_signatures`) cost one stage's runs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

__all__ = ["shared_stages"]


def shared_stages(signatures: list[tuple[tuple, dict[int, int]]], pp: int,
                  cuts: Callable[[int], Hashable]) -> dict[int, int]:
    """``{stage: source}``: the middle stages planned from the runs of ``source``, the first middle
    stage of their signature and micro-batch cuts (``cuts(stage)``, `microbatch_cut.planning_cuts`;
    stages without cuts run on their own); every other stage runs."""
    groups: dict[tuple, list[int]] = {}
    for stage in range(1, pp - 1):
        if (cut := cuts(stage)) is not None:
            groups.setdefault((signatures[stage][0], cut), []).append(stage)
    return {stage: members[0] for members in groups.values() for stage in members[1:]}
