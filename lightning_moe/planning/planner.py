"""`plan`: the memory and communication of one training step of a ``lightning-moe fit`` configuration,
per rank, before any GPU is rented.

Runs the configuration's real setup and training step (`lightning_moe.planning.fake_fit`) once per
distinct rank role: the first rank of every pipeline stage (ranks of one stage hold the same shapes:
the layouts shard evenly, routing is taken balanced times ``imbalance``), several at once in forked
processes (`lightning_moe.planning.rank_runs`). With ``fast=True`` a pipeline stage is drawn from
steps with fewer micro-batches (`lightning_moe.planning.microbatch_cut`), the middle stages holding
the same kinds of blocks from one of them (`lightning_moe.planning.stage_roles`), and a stage's
repeated blocks are extrapolated from runs with one and two of them
(`lightning_moe.planning.repeated_blocks`). The largest rank is the answer; every stage is
reported.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from lightning_moe.parallel.layout.dims import ParallelDims
from lightning_moe.planning.fake_fit import fake_fit_steps
from lightning_moe.planning.fake_objects import FakeObjects
from lightning_moe.planning.layouts import cross_node_warnings
from lightning_moe.planning.microbatch_cut import MicrobatchCut, draw, planning_cuts, schedule_shape
from lightning_moe.planning.plan_config import PlanConfigError, configuration_parsed_once, read_layout
from lightning_moe.planning.rank_runs import default_jobs, run_ranks
from lightning_moe.planning.rank_step import LINEAR_FIELDS, RankStep
from lightning_moe.planning.repeated_blocks import BlockCut, extrapolate
from lightning_moe.planning.stage_roles import shared_stages
from lightning_moe.planning.step_probe import Collective

__all__ = [
    "COMMUNICATION_KINDS", "Plan", "StagePlan", "classify_collective", "communication_bytes", "parse_bytes", "plan",
]

COMMUNICATION_KINDS = (
    "token_dispatch", "tensor_parallel", "context_parallel", "fsdp", "gradient_reduction", "pipeline", "other",
)
"""The kinds of collectives a plan sums bytes for (see `classify_collective`)."""

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"80GB"`` (10^9), ``"80GiB"`` (2^30), ``"141e9"`` or an int, as bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise PlanConfigError(f"cannot read {text!r} as a memory size: write e.g. 80GB, 141GB or 96GiB.")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass
class StagePlan:
    """One pipeline stage's planned rank: its `RankStep` and the bytes per kind of collective."""

    stage: int
    step: RankStep
    communication: dict[str, int]

    def bytes(self) -> dict[str, int]:
        """The numbers of ``per_rank`` in ``--json``: ``peak_bytes`` is the sum of the first four;
        ``dispatch_bytes`` is the token dispatchers' part of ``activation_bytes``."""
        step = self.step
        return {
            "params_bytes": step.params_bytes, "grads_bytes": step.grads_bytes,
            "optimizer_bytes": step.optimizer_bytes, "activation_bytes": step.activation_bytes,
            "peak_bytes": step.peak_bytes, "dispatch_bytes": step.dispatch_bytes,
        }


@dataclass
class Plan:
    """What `plan` found: every stage's planned rank, the layout, and whether the largest fits."""

    args: list[str]
    dims: ParallelDims
    sharding_strategy: str
    precision: str
    devices_per_node: int
    num_nodes: int
    imbalance: float
    stages: list[StagePlan]
    gpu_memory: int | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def largest(self) -> StagePlan:
        """The stage whose rank peaks highest."""
        return max(self.stages, key=lambda s: s.step.peak_bytes)

    @property
    def fits(self) -> bool | None:
        """Whether the largest rank's peak fits ``gpu_memory`` (None without it)."""
        return None if self.gpu_memory is None else self.largest.step.peak_bytes <= self.gpu_memory

    @property
    def headroom(self) -> int | None:
        """``gpu_memory`` minus the largest peak (negative: short by that much)."""
        return None if self.gpu_memory is None else self.gpu_memory - self.largest.step.peak_bytes

    def layout(self) -> dict[str, Any]:
        """The layout's sizes, as ``--json`` gives them."""
        d = self.dims
        return {
            "world_size": d.world_size, "num_nodes": self.num_nodes, "devices_per_node": self.devices_per_node,
            "tensor_parallel_size": d.tp, "context_parallel_size": d.cp, "pipeline_parallel_size": d.pp,
            "data_parallel_size": d.dp, "expert_parallel_size": d.ep, "expert_tensor_parallel_size": d.etp,
            "expert_data_parallel_size": d.edp, "sharding_strategy": self.sharding_strategy,
            "precision": self.precision,
        }

    def to_json(self) -> dict[str, Any]:
        """One JSON object: ``per_rank`` (the largest rank), ``per_stage``, ``layout``, ``communication_bytes``,
        ``gpu_memory_bytes``, ``fits``, ``headroom_bytes``, ``imbalance``, ``warnings``."""
        largest = self.largest
        return {
            "per_rank": {"rank": largest.step.rank, "stage": largest.stage, **largest.bytes()},
            "per_stage": [{"stage": s.stage, "rank": s.step.rank, **s.bytes(), "communication_bytes": s.communication}
                          for s in self.stages],
            "layout": self.layout(),
            "communication_bytes": largest.communication,
            "gpu_memory_bytes": self.gpu_memory, "fits": self.fits, "headroom_bytes": self.headroom,
            "imbalance": self.imbalance, "warnings": list(self.warnings),
        }


def plan(args: list[str], *, imbalance: float | None = None, gpu_memory: int | str | None = None,
         measure_step: int = 1, jobs: int | None = None, fast: bool = False) -> Plan:
    """Plan ``lightning-moe fit ARGS``: run its setup and step as the first rank of every pipeline stage.

    ``imbalance``: routing imbalance (each expert gets this times its balanced share); default
    the configured ``capacity_factor`` when there is one (dropped rows bound what an expert gets),
    else 1.0, which a real router exceeds: the report says so. ``gpu_memory``: the device's bytes
    (or e.g. ``"80GB"``) to say whether the largest rank fits. ``jobs``: how many ranks are
    planned at once, in forked processes (default: one per CPU; 1: one after another in this
    process; see `lightning_moe.planning.rank_runs`). ``fast``: plan a pipeline stage from one run
    measuring a step with two and one with three micro-batches in flight
    (`lightning_moe.planning.microbatch_cut`: exact on the tested layouts; DeepSeek-V3 on 1024 GPUs
    17 times faster than running every micro-batch), the middle stages that hold the same
    kinds of blocks from one of them (`lightning_moe.planning.stage_roles`), and a stage with many
    blocks of one kind from runs with one and two of them (`lightning_moe.planning.repeated_blocks`:
    2.3 times faster on DeepSeek-V3's last stage, whose peak it puts 1.3% higher than running every
    block; equal on the tested small layouts). The configuration is parsed once
    (`~lightning_moe.planning.plan_config.configuration_parsed_once`).
    """
    with configuration_parsed_once():
        return _plan(args, imbalance, parse_bytes(gpu_memory) if gpu_memory is not None else None, measure_step,
                     jobs, fast)


def _plan(args: list[str], imbalance: float | None, gpu_memory: int | None, measure_step: int, jobs: int | None,
          fast: bool) -> Plan:
    layout = read_layout(args)
    dims = layout.dims
    warnings = cross_node_warnings(dims, layout.devices_per_node) if layout.num_nodes > 1 else []
    if imbalance is None:
        imbalance = layout.capacity_factor or 1.0
        if layout.capacity_factor is None and layout.has_experts:
            warnings.append(
                "routing is planned perfectly balanced (--imbalance 1.0); real routers are not: plan with "
                "--imbalance 1.2 or more to leave room for the busiest expert."
            )
    roles = {stage: min(r for r in range(dims.world_size) if dims.coords(r).pp == stage) for stage in range(dims.pp)}
    # Stage 0 first, then the last stage: they send the boundary shapes the others wait for.
    order = sorted(roles.values(), key=lambda r: (dims.coords(r).pp not in (0, dims.pp - 1), dims.coords(r).pp))

    # The steps a cut run measures must each start holding what a step leaves: not the first step.
    def cut_for(stage: int, serves: int) -> tuple[MicrobatchCut, MicrobatchCut] | None:
        return _microbatch_cuts(layout, stage, serves) if fast and measure_step >= 1 else None

    # The middle stages' cuts as if their runs served others, until the stages sharing them are known.
    cuts = {stage: cut_for(stage, 1 if stage in (0, dims.pp - 1) else dims.pp) for stage in roles}

    def run(key: _RunKey, objects: FakeObjects) -> list[RankStep]:
        rank, grown, microbatches = key
        return fake_fit_steps(args, rank, dims.world_size, imbalance=imbalance, measure_step=measure_step,
                              objects=objects, cut=BlockCut(grown) if fast else None, microbatches=microbatches)

    jobs = default_jobs(len(order)) if jobs is None else jobs
    runs, signatures, shared = _run_stages(order, dims, run, jobs, fast, cuts, cut_for)

    @functools.cache  # a run serves every stage drawn from it
    def sent(key: _Key) -> dict[str, int]:
        return communication_bytes(runs[key].collectives, dims, key[0], layout.sharding_strategy)

    def drawn(stage: int, grown: int | None) -> _Run:
        """The stage's step with one block of each cut kind (``grown``: two of that kind)."""
        source = shared.get(stage, stage)
        rank = roles[source]
        if cuts[source] is None:
            return runs[rank, grown, None], sent((rank, grown, None))
        lo, hi = cuts[source]
        held = signatures[stage][1] if stage in shared else runs[rank, grown, lo].cut_blocks
        shape = schedule_shape(layout.pipeline_schedule, layout.num_microbatches, dims.pp, stage)
        return draw((runs[rank, grown, lo], sent((rank, grown, lo))), (runs[rank, grown, hi], sent((rank, grown, hi))),
                    (lo, hi), shape, rank=roles[stage], held=held)

    def stage_plan(stage: int) -> StagePlan:
        base = drawn(stage, None)
        return _whole_stage(stage, base, {kind: drawn(stage, kind) for kind in base[0].cut_blocks})

    stages = [stage_plan(stage) for stage in sorted(roles)]
    return Plan(list(args), dims, layout.sharding_strategy, layout.precision, layout.devices_per_node,
                layout.num_nodes, imbalance, stages, gpu_memory, warnings)


_Run = tuple[RankStep, dict[str, int]]
"""A planning run's step and the bytes it sends per kind of collective."""

_Key = tuple[int, int | None, MicrobatchCut | None]
"""A planned step: the rank, the cut kind it keeps two blocks of (None: one of each), its micro-batches."""

_RunKey = tuple[int, int | None, tuple[MicrobatchCut, ...] | None]
"""A planning run: the rank, the cut kind it keeps two blocks of, the micro-batches of its measured steps."""


def _microbatch_cuts(layout, stage: int, serves: int = 1) -> tuple[MicrobatchCut, MicrobatchCut] | None:
    """The runs a pipeline stage is planned from with fewer micro-batches (`microbatch_cut`) when
    they serve ``serves`` stages, or None."""
    if layout.dims.pp == 1 or layout.virtual_stages != 1:
        return None
    return planning_cuts(layout.pipeline_schedule, layout.num_microbatches, layout.dims.pp, stage, serves)


def _run_stages(order: list[int], dims: ParallelDims, run, jobs: int, fast: bool,
                cuts: dict[int, tuple[MicrobatchCut, MicrobatchCut] | None], cut_for):
    """Run the planning runs: every stage's first rank (with ``fast``: its micro-batch cuts, the runs
    with two blocks of each cut kind, the middle stages sharing another's runs left out
    (`lightning_moe.planning.stage_roles`)). ``cuts`` (updated here for the middle stages, once it
    is known which stages their runs serve): each stage's micro-batch cuts; ``cut_for(stage,
    serves)`` decides them. Returns the measured steps (``{(rank, grown kind or None,
    micro-batch cut or None): step}``), the stages' signatures and ``{stage: stage whose runs it is drawn from}``."""
    shared: dict[int, int] = {}

    def run_key(rank: int, grown: int | None = None) -> _RunKey:
        return rank, grown, cuts[dims.coords(rank).pp]  # one run measures a step per micro-batch cut

    def middle_stages(stage_zero: RankStep) -> list[int]:
        """The middle stages' first ranks that need runs of their own, ``cuts`` set for them."""
        if stage_zero.stage_signatures:
            shared.update(shared_stages(stage_zero.stage_signatures, dims.pp, cuts.get))
        served = Counter(shared.values())
        for stage in range(1, dims.pp - 1):
            if stage not in shared:
                cuts[stage] = cut_for(stage, served[stage] + 1)
        for stage, source in list(shared.items()):
            if cuts[source] is None:  # too few stages share its runs for the cut to pay: each runs whole
                del shared[stage]
                cuts[stage] = cut_for(stage, 1)
        return [r for r in order if dims.coords(r).pp not in (0, dims.pp - 1, *shared)]

    def then(key: _RunKey, steps: list[RankStep]) -> list[_RunKey]:
        """The runs a finished one asks for: stage 0's, the middle stages' (they are known by its
        stage signatures); a run with one block of each cut kind, its runs with two of each."""
        rank, grown, _ = key
        if grown is not None:
            return []
        middle = [run_key(r) for r in middle_stages(steps[0])] if rank == order[0] else []
        return [*middle, *(run_key(rank, kind) for kind in steps[0].cut_blocks)]

    ends = [r for r in order if dims.coords(r).pp in (0, dims.pp - 1)] if fast else order
    # Every run starts as soon as a worker is free and what it needs is known: the middle stages'
    # once stage 0's has run, the runs with two blocks once the stage's run with one has.
    done = run_ranks([run_key(rank) for rank in ends], run, jobs, {}, then if fast else None)
    runs = {(rank, grown, cut): step for (rank, grown, measured), steps in done.items()
            for cut, step in zip(measured or (None,), steps, strict=True)}
    return runs, done[run_key(order[0])][0].stage_signatures, shared


def _whole_stage(stage: int, base: _Run, grown: dict[int, _Run]) -> StagePlan:
    """The stage's plan from its run with one block of each cut kind and, per kind, the run with
    two of it (`lightning_moe.planning.repeated_blocks`); the run itself when nothing was cut."""
    base_step, base_bytes = base
    if not grown:
        return StagePlan(stage, base_step, base_bytes)
    held = base_step.cut_blocks

    def whole(base_value: int, grown_value) -> int:
        return round(extrapolate(base_value, {k: grown_value(s) for k, (s, _) in grown.items()}, held))

    values = {name: whole(getattr(base_step, name), lambda s, name=name: getattr(s, name)) for name in LINEAR_FIELDS}
    # The dispatchers' buffers at the peak belong to the layer running then, not to every block: the
    # run with the most blocks tells them best.
    values["dispatch_bytes"] = max(s.dispatch_bytes for s, _ in grown.values())
    # Each phase's peak grows by its own amount per block (the forward's by what a block keeps, the
    # backward's less what it frees): the step's peak is the largest of the phases' peaks.
    phases = {phase: whole(peak, lambda s, phase=phase: s.phase_peaks[phase])
              for phase, peak in base_step.phase_peaks.items()}
    values["peak_bytes"] = max([values["start_bytes"], *phases.values()])
    whole_step = dataclasses.replace(base_step, collectives=[], phase_peaks=phases, **values)
    return StagePlan(stage, whole_step, {
        kind: round(extrapolate(base_bytes[kind], {k: b[kind] for k, (_, b) in grown.items()}, held))
        for kind in base_bytes
    })


def classify_collective(c: Collective, groups: dict[str, tuple[int, ...]], fsdp: bool) -> str:
    """The kind of ``c`` (one of `COMMUNICATION_KINDS`), by what issued it and over which group:
    sends of ring attention are context parallelism's, other sends and receives the pipeline's;
    all-to-alls and the expert layers' gathers (ETP, the allgather dispatcher) move tokens; the
    gradient sync's reductions are the data-parallel reduction; then by group: the TP group's are
    tensor parallelism's, FSDP2's data-parallel gathers and scatters under ``FULL_SHARD`` FSDP's, the
    CP group's context parallelism's; anything else (norms, loss and statistics reductions) other."""
    if c.kind in ("send", "recv"):
        return "context_parallel" if c.site == "ring.py" else "pipeline"  # parallel/context_parallel/ring.py
    if c.kind == "all_to_all" or (c.site in ("collectives.py", "allgather.py") and (c.module or "").startswith("layers")
                                  and c.kind in ("all_gather", "reduce_scatter")):
        return "token_dispatch"
    if c.site in ("grad_sync.py", "sharded_grad_sync.py"):
        return "gradient_reduction"
    if c.ranks == groups["tp"] and len(c.ranks) > 1:
        return "tensor_parallel"
    if fsdp and c.kind in ("all_gather", "reduce_scatter") and c.ranks in (groups["dp_cp"], groups["edp"], groups["dp"]):
        return "fsdp"
    if c.ranks == groups["cp"] and len(c.ranks) > 1:
        return "context_parallel"
    return "other"


def communication_bytes(collectives: list[Collective], dims: ParallelDims, rank: int,
                        sharding_strategy: str) -> dict[str, int]:
    """Bytes ``rank`` of ``dims`` sends for ``collectives`` (`Collective.sent_bytes`), per kind."""
    groups = {name: tuple(dims.group_of(name, rank)) for name in ("tp", "cp", "dp", "dp_cp", "edp")}
    totals = Counter({kind: 0 for kind in COMMUNICATION_KINDS})
    for c in collectives:
        totals[classify_collective(c, groups, sharding_strategy != "NO_SHARD")] += c.sent_bytes
    return dict(totals)
