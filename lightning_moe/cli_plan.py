"""``lightning-moe plan``: will this layout fit, and which layout is best, before renting a GPU.

    lightning-moe plan --config examples/configs/plan/qwen3_30b_a3b_8gpu.yaml --gpu_memory 80GB
    lightning-moe plan --config CONFIG.yaml --trainer.strategy.init_args.expert_parallel_size=4 --json
    lightning-moe plan --config CONFIG.yaml --gpu_memory 80GB --search     # every layout of the world size

Takes what ``lightning-moe fit`` takes (``--config`` and the same overrides) and runs the
configuration's real setup and one training step per pipeline stage in this process, as one rank
of the configured world on torch's fake process group with fake tensors: no GPU, no data, no
other process (:mod:`lightning_moe.planning`). A configuration for GPUs (``accelerator`` ``gpu``,
``cuda``, or ``auto`` and unset) is planned with the GPU's kernels' memory. Printed for the largest
rank, and per pipeline stage: the bytes of parameters, gradients, optimizer states, activations and
buffers at the peak (the token dispatchers' part apart), the peak; with ``--gpu_memory`` whether it
fits; the bytes the rank sends per step by kind of collective; a warning for a TP, CP, EP or ETP group
that spans nodes. ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from jsonargparse import ArgumentParser

from lightning_moe.planning.layouts import Layout, valid_layouts
from lightning_moe.planning.plan_config import (
    PlanConfigError,
    callers_state_kept,
    data_shape,
    is_reference,
    plan_cli,
)
from lightning_moe.planning.planner import Plan, parse_bytes, plan

__all__ = ["PLAN_HELP", "format_plan", "plan_main", "plan_parser", "search_layouts"]

PLAN_HELP = "Plan a fit configuration's per-rank memory and communication (no GPU needed); --search ranks layouts."
_PROG = "lightning-moe"
_GIB = 2**30


def plan_parser() -> ArgumentParser:
    """The parser of ``lightning-moe plan``'s own options (the rest is ``fit``'s)."""
    parser = ArgumentParser(
        prog=f"{_PROG} plan",
        description=(
            f"{PLAN_HELP} Every other option is lightning-moe fit's (--config, --trainer.*, --model.*, --data.*; see "
            "lightning-moe fit --help): the plan runs that configuration's setup and one training step per pipeline "
            "stage on fake tensors, as the first rank of each stage, in this process."
        ),
    )
    parser.add_argument("--json", action="store_true", help="Print one JSON object (per_rank, per_stage, layout, ...).")
    parser.add_argument(
        "--gpu_memory", default=None,
        help="The device's memory (e.g. 80GB, 141GB, 96GiB): say whether the largest rank fits, and the headroom.",
    )
    parser.add_argument(
        "--imbalance", type=float, default=None,
        help="Routing imbalance: every expert receives this times its balanced share of rows (default: the "
        "configured capacity_factor, else 1.0 with a warning).",
    )
    parser.add_argument(
        "--search", action="store_true",
        help="Plan every valid layout of the configured world size (TP, CP, PP, EP, ETP, NO_SHARD/FULL_SHARD) and "
        "rank those that fit by peak and communication, with the command line that runs each (one plan per "
        "layout: minutes for a large model).",
    )
    parser.add_argument("--search_top", type=int, default=10, help="--search: how many layouts to print.")
    parser.add_argument(
        "--fast", action="store_true",
        help="Plan a pipeline stage from steps with two and three micro-batches in flight instead of all of them, "
        "the middle pipeline stages with the same kinds of blocks from one of them (exact on the tested layouts), "
        "and a stage's run of identical blocks from runs with one and two of them (equal on the tested small "
        "layouts, 1.3% higher peak on DeepSeek-V3's last stage): DeepSeek-V3 on 1024 GPUs in under a minute "
        "on 2 cores (default: run every micro-batch and block of every stage).",
    )
    parser.add_argument(
        "--jobs", type=int, default=None,
        help="How many pipeline stages are planned at once, each in a forked process (default: one per CPU; "
        "1: one after another in this process).",
    )
    return parser


_OWN_FLAGS = {
    "--json": False, "--search": False, "--gpu_memory": True, "--imbalance": True, "--search_top": True, "--jobs": True,
    "--fast": False,
}


def _split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(plan's own options, fit's)."""
    own, fit, i = [], [], 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name in _OWN_FLAGS:
            takes_value = _OWN_FLAGS[name] and "=" not in argv[i]
            own += argv[i : i + 1 + takes_value]
            i += 1 + takes_value
        else:
            fit.append(argv[i])
            i += 1
    return own, fit


def plan_main(argv: list[str]) -> Plan | list[tuple[Layout, Plan]]:
    """``lightning-moe plan ARGV``: plan and print; a configuration the planner cannot run exits with
    status 2 and a one-line message."""
    if any(a in ("-h", "--help") for a in argv):
        plan_parser().print_help()
        raise SystemExit(0)
    own, fit_args = _split_args(argv)
    options = plan_parser().parse_args(own)
    try:
        with _planner_output_quiet():
            gpu_memory = None if options.gpu_memory is None else parse_bytes(options.gpu_memory)
            if options.search:
                ranked = search_layouts(fit_args, imbalance=options.imbalance, gpu_memory=gpu_memory,
                                        progress=lambda text: print(text, file=sys.stderr, flush=True),
                                        jobs=options.jobs, fast=options.fast)
                _print_search(ranked, options.search_top, options.json)
                return ranked
            result = plan(fit_args, imbalance=options.imbalance, gpu_memory=gpu_memory, jobs=options.jobs,
                          fast=options.fast)
    except (PlanConfigError, ValueError) as err:
        print(f"{_PROG} plan: error: {' '.join(str(err).split())}", file=sys.stderr)
        raise SystemExit(2) from err
    print(json.dumps(result.to_json(), indent=2) if options.json else format_plan(result))
    return result


@contextmanager
def _planner_output_quiet() -> Iterator[None]:
    """Lightning's start-up lines (accelerators, seed) and warnings (no validation loader,
    deprecations) describe the planner's own CPU run, not the plan: silenced for the body only."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


# -- the report ----------------------------------------------------------------------------------


def _gib(n: int) -> str:
    """Bytes in the unit that reads best: GiB from 1 GiB on, MiB from 1 MiB, else KiB."""
    for unit, size in (("GiB", _GIB), ("MiB", 2**20)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n / 2**10:,.2f} KiB"


def format_plan(result: Plan) -> str:
    """The plan as text: the layout, the largest rank's bytes, every stage, fit, communication, warnings."""
    d, largest = result.dims, result.largest
    lines = [
        f"lightning-moe plan: {d.describe()}, {result.sharding_strategy}, {result.precision}, "
        f"{result.num_nodes} node(s) x {result.devices_per_node} devices, routing imbalance {result.imbalance:g}",
        f"largest rank: {largest.step.rank} (pipeline stage {largest.stage})",
    ]
    labels = {"params_bytes": "parameters", "grads_bytes": "gradients", "optimizer_bytes": "optimizer states",
              "activation_bytes": "activations and buffers at the peak",
              "dispatch_bytes": "  of which token-dispatch buffers", "peak_bytes": "peak"}
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "dispatch_bytes", "peak_bytes"):
        lines.append(f"  {labels[key]:<38}{_gib(largest.bytes()[key]):>14}")
    if result.fits is not None:
        gpu = _gib(result.gpu_memory)
        verdict = (f"fits in {gpu}: yes, {_gib(result.headroom)} headroom" if result.fits
                   else f"fits in {gpu}: NO, short by {_gib(-result.headroom)}")
        lines.append(verdict)
    if len(result.stages) > 1:
        lines.append("per pipeline stage (its first rank):")
        for stage in result.stages:
            b = stage.bytes()
            lines.append(f"  stage {stage.stage} (rank {stage.step.rank}): params {_gib(b['params_bytes'])}, "
                         f"optimizer {_gib(b['optimizer_bytes'])}, peak {_gib(b['peak_bytes'])}")
    lines.append(f"bytes sent per step, rank {largest.step.rank}:")
    for kind, value in largest.communication.items():
        if value:
            lines.append(f"  {kind.replace('_', ' '):<38}{_gib(value):>14}")
    cut = [f"stage {s.stage}: {sum(s.step.cut_blocks.values())}" for s in result.stages if s.step.cut_blocks]
    if cut:
        lines.append(f"repeated blocks extrapolated from runs with 1 and 2 of them ({', '.join(cut)} blocks; "
                     "without --fast every block runs)")
    lines += [f"warning: {w}" for w in result.warnings]
    return "\n".join(lines)


# -- --search ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    num_experts: int
    num_attention_heads: int
    num_kv_heads: int
    num_layers: int
    seq_len: int
    batch_size: int
    vocab_size: int
    hidden_size: int


def _model_shape(fit_args: list[str]) -> tuple[int, _Shape, dict[str, Any]]:
    """(world size, the reference model's and data's sizes, the strategy's pipeline options)."""
    import tempfile

    with callers_state_kept(), tempfile.TemporaryDirectory(prefix="lightning-moe-plan-") as root:
        cli = plan_cli(fit_args, 1, root)
    if not is_reference(cli):
        raise PlanConfigError("--search needs the reference MoELanguageModel (it reads the model's sizes); plan your "
                              "own model's layouts one by one without --search.")
    config, strategy = cli.model.config, cli.trainer.strategy
    seq_len, batch_size = data_shape(cli)
    shape = _Shape(config.moe.num_experts, config.num_attention_heads, config.num_kv_heads, config.num_layers,
                   seq_len, batch_size, config.vocab_size, config.hidden_size)
    return strategy.num_nodes * strategy.num_processes, shape, {"num_microbatches": strategy.num_microbatches}


def search_layouts(fit_args: list[str], *, imbalance: float | None = None, gpu_memory: int | None = None,
                   progress=None, jobs: int | None = None, fast: bool = False) -> list[tuple[Layout, Plan]]:
    """Plan every valid layout of the configuration's world size; returns ``(layout, plan)`` pairs,
    those that fit first (all, without ``gpu_memory``), each group by peak, then by communication bytes.
    ``jobs``, ``fast``: `plan`'s, for each layout. ``progress(text)``: called with each layout, each
    skipped and each failed one; a layout the planner fails on is left out with a warning (through
    ``progress`` when given) instead of ending the search."""
    world, shape, pipeline = _model_shape(fit_args)
    layouts = valid_layouts(
        world, num_experts=shape.num_experts, num_attention_heads=shape.num_attention_heads,
        num_kv_heads=shape.num_kv_heads, num_layers=shape.num_layers, seq_len=shape.seq_len,
        batch_size=shape.batch_size, vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, **pipeline,
    )
    planned, failed = [], []
    for i, layout in enumerate(layouts):
        if progress is not None:
            progress(f"[{i + 1}/{len(layouts)}] {layout.describe()}")
        overrides = _layout_overrides(layout, pipeline["num_microbatches"], shape.batch_size)
        if overrides is None:
            if progress is not None:
                progress(f"  skipped: data.batch_size={shape.batch_size} does not split into {layout.pp} micro-batches")
            continue
        args = [*fit_args, *overrides]
        try:
            planned.append((layout, plan(args, imbalance=imbalance, gpu_memory=gpu_memory, jobs=jobs, fast=fast)))
        except (PlanConfigError, ValueError) as err:  # a check of the real setup refused it
            if progress is not None:
                progress(f"  skipped: {' '.join(str(err).split())[:200]}")
        except Exception as err:  # the planner failed: keep the search's other layouts
            failed.append((layout, err))
            if progress is not None:
                progress(f"  could not plan: {_last_line(err)}")
    if failed:
        layout, err = failed[0]
        message = (
            f"lightning-moe plan --search could not plan {len(failed)} of {len(layouts)} layouts (first: "
            f"{layout.describe()}: {_last_line(err)}); they are left out "
            "of the ranking. Plan one alone (without --search, with --jobs 1) to see its traceback, and please "
            "report it: a layout the setup accepts should plan."
        )
        if progress is None:
            warnings.warn(message, stacklevel=2)
        else:
            progress(f"warning: {message}")

    def key(item: tuple[Layout, Plan]) -> tuple:
        _, p = item
        return (p.fits is False, p.largest.step.peak_bytes, sum(p.largest.communication.values()))

    return sorted(planned, key=key)


def _last_line(err: Exception) -> str:
    """The error's type and the last line of its message (a worker's error carries its traceback
    before the line that says what failed)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1][:300] if lines else ''}"


def _command(p: Plan) -> str:
    """The ``lightning-moe fit`` command that runs what ``p`` planned."""
    return shlex.join(["lightning-moe", "fit", *p.args])


def _layout_overrides(layout: Layout, micro: int, batch_size: int) -> list[str] | None:
    """The strategy arguments of ``layout``; under PP at least as many micro-batches as stages (1F1B's
    rule), dividing the batch (None: it cannot)."""
    args = [f"--trainer.strategy.init_args.{name}={value}" for name, value in layout.strategy_args().items()]
    if layout.pp > 1 and micro < layout.pp:
        if batch_size % layout.pp:
            return None
        args.append(f"--trainer.strategy.init_args.num_microbatches={layout.pp}")
    return args


def _print_search(ranked: list[tuple[Layout, Plan]], top: int, as_json: bool) -> None:
    if as_json:
        print(json.dumps([{"command": _command(p), **p.to_json()} for _, p in ranked[:top]], indent=2))
        return
    fitting = [item for item in ranked if item[1].fits is not False]
    known = ranked and ranked[0][1].gpu_memory is not None
    head = f"{len(fitting)} of {len(ranked)} layouts fit" if known else f"{len(ranked)} layouts"
    print(f"lightning-moe plan --search: {head}; best first (peak, then collective bytes per step):")
    for layout, p in ranked[:top]:
        comm = sum(p.largest.communication.values())
        fit = "" if p.fits is None else ("fits" if p.fits else "does not fit")
        print(f"  {layout.describe():<40} peak {_gib(p.largest.step.peak_bytes):>12}  collectives {_gib(comm):>12}  {fit}")
        print(f"    {_command(p)}")
