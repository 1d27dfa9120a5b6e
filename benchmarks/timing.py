"""Timing helpers shared by the benchmarks: interleaved rounds, medians, ratio tables.

Machines here are noisy, so every case of a suite runs once per round, rounds interleave the
cases, and results are reported as ratios to a baseline measured in the same run.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Case:
    """One benchmarked callable and its measured wall times in seconds."""

    name: str
    step: Callable[[], None]
    notes: str = ""
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)


def run_interleaved(cases: list[Case], rounds: int, warmup: int = 1) -> None:
    """Run every case ``warmup`` times, then ``rounds`` timed rounds, cases interleaved."""
    for case in cases:
        for _ in range(warmup):
            case.step()
    for _ in range(rounds):
        for case in cases:
            gc.collect()
            start = time.perf_counter()
            case.step()
            case.times.append(time.perf_counter() - start)


def ratio_table(title: str, cases: list[Case], baseline: Case) -> str:
    """A markdown table of median / best times and their ratios to ``baseline``."""
    lines = [
        f"### {title}",
        "",
        "| case | median ms | best ms | ratio (median) | ratio (best) | notes |",
        "|---|---|---|---|---|---|",
    ]
    for case in cases:
        lines.append(
            f"| {case.name} | {case.median * 1e3:.1f} | {case.best * 1e3:.1f} | "
            f"{case.median / baseline.median:.3f}x | {case.best / baseline.best:.3f}x | {case.notes} |"
        )
    return "\n".join(lines)


def write_tables(path: str, tables: list[str]) -> None:
    """Write markdown ``tables`` to ``path`` (nothing when ``path`` is empty), as printed."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n\n".join(tables) + "\n")
