"""A ``lightning-moe fit`` configuration as the planner reads it: the same parser and checks as ``fit``,
the run shortened to the planned steps and run on the CPU (`plan_cli`), and what it asks for
(`read_layout`)."""

from __future__ import annotations

import copy
import importlib
import os
import random
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import lightning as L
import torch

from lightning_moe.callbacks import ActivationOffload, CUDAGraphCapture, SelectiveRecompute
from lightning_moe.parallel.layout.dims import ParallelDims

__all__ = [
    "MEMORY_CALLBACKS", "PlanConfigError", "PlannedLayout", "callers_state_kept", "configuration_parsed_once",
    "data_shape", "is_memory_callback", "is_reference", "plan_cli", "read_layout",
]


@contextmanager
def callers_state_kept() -> Iterator[None]:
    """Run the body and give the caller's process back as it was: environment variables (a
    configuration's ``seed_everything`` sets ``PL_GLOBAL_SEED``, which later Trainers would read), the
    torch and Python random states, ``rank_zero_only.rank`` (MoEStrategy sets it to the fake rank)
    and the warning filters (it silences deprecations on ranks other than 0)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    environment, python_random = dict(os.environ), random.getstate()
    rank = getattr(rank_zero_only, "rank", None)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(environment)
            random.setstate(python_random)
            if rank is None:
                vars(rank_zero_only).pop("rank", None)
            else:
                rank_zero_only.rank = rank

MEMORY_CALLBACKS = (SelectiveRecompute, ActivationOffload, CUDAGraphCapture)
"""The callbacks of a configuration a shortened run keeps (`plan_cli`): they change what a step holds."""

_GPU_ACCELERATORS = ("gpu", "cuda", "auto")


class PlanConfigError(ValueError):
    """The configuration cannot be planned; the message says why and what to change."""


@dataclass(frozen=True)
class PlannedLayout:
    """What a configuration asks for, read without running it (`read_layout`)."""

    dims: ParallelDims
    sharding_strategy: str
    precision: str
    """As configured (the planner runs ``16-mixed`` as ``bf16-mixed``)."""
    devices_per_node: int
    num_nodes: int
    capacity_factor: float | None
    has_experts: bool
    pipeline_schedule: str = "1F1B"
    """The pipeline schedule (with ``pipeline_parallel_size > 1``)."""
    num_microbatches: int = 1
    """Micro-batches per step of the pipeline schedule."""
    virtual_stages: int = 1
    """Pipeline stages per rank."""


def read_layout(args: list[str]) -> PlannedLayout:
    """Parse and check ``lightning-moe fit ARGS`` as ``fit`` does before it launches, without running it."""
    with callers_state_kept(), tempfile.TemporaryDirectory(prefix="lightning-moe-plan-") as root:
        cli = plan_cli(args, 1, root)
    strategy = cli.trainer.strategy
    if not hasattr(type(strategy), "parallel_context"):
        raise PlanConfigError(
            f"the planner plans MoEStrategy runs; the configuration's strategy is {type(strategy).__name__}: set "
            "trainer.strategy to lightning_moe.strategies.MoEStrategy (or 'moe')."
        )
    moe = getattr(getattr(cli.model, "config", None), "moe", None)
    pipeline = getattr(strategy, "_pipeline", None)
    schedule = {} if pipeline is None else {
        "pipeline_schedule": pipeline.schedule, "num_microbatches": pipeline.num_microbatches,
        "virtual_stages": pipeline.virtual_stages,
    }
    return PlannedLayout(
        strategy.parallel_dims(strategy.num_nodes * strategy.num_processes), strategy.sharding_strategy,
        cli.precision, strategy.num_processes, strategy.num_nodes,
        getattr(moe, "capacity_factor", None), any(True for _ in _expert_layers(cli.model)), **schedule,
    )


def _expert_layers(module):
    from lightning_moe.layers.moe import MoELayer

    config = getattr(module, "config", None)
    if getattr(config, "moe", None) is not None:  # the reference model, built only in configure_model
        yield config.moe
    yield from (m for m in module.modules() if isinstance(m, MoELayer))


def plan_cli(args: list[str], measure_step: int, root: str, *, on_cpu: bool = True):
    """``lightning-moe fit ARGS``, parsed and checked as ``fit`` does, shortened to ``measure_step + 1``
    optimizer steps: no logger, checkpoint, progress bar, summary or validation, only the
    `MEMORY_CALLBACKS` of the configuration, files under ``root``. ``on_cpu``: run on the CPU
    accelerator (the planner; ``16-mixed`` as ``bf16-mixed``), remembering in ``planned_for_gpu``
    whether the configuration asked for GPUs; False keeps the configured accelerator (a real run
    measured for comparison). Returns the CLI, its objects built, nothing run."""
    from jsonargparse import set_parsing_settings

    from lightning_moe.cli import MoECLI, check_config_before_launch, check_layout_before_launch

    class PlanCLI(MoECLI):
        """``lightning-moe fit``'s parser and checks, the run shortened to the planned step."""

        planned_for_gpu = False
        precision = "32-true"

        def before_instantiate_classes(self) -> None:
            super().before_instantiate_classes()
            trainer = self.config.trainer
            self.planned_for_gpu = str(trainer.get("accelerator") or "auto") in _GPU_ACCELERATORS
            self.precision = str(trainer.get("precision") or "32-true")
            if on_cpu:
                trainer.accelerator = "cpu"
                if self.precision in ("16-mixed", "16"):
                    trainer.precision = "bf16-mixed"  # the same bytes; CPU autocast runs bf16
            callbacks = trainer.get("callbacks") or []
            callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
            trainer.callbacks = [c for c in callbacks if is_memory_callback(c)]

        def parse_arguments(self, parser, args) -> None:
            # Within `configuration_parsed_once`, the first run parses, the later ones take a copy
            # with their own step count and folder (the only overrides that differ between runs).
            key = tuple(args[:-len(per_run)])
            parsed = None if _parsed is None else _parsed.get(key)
            if parsed is None:
                super().parse_arguments(parser, args)
                if _parsed is not None:
                    _parsed[key] = copy.deepcopy(self.config)
                return
            self.config = copy.deepcopy(parsed)
            self.config.trainer.max_steps = measure_step + 1
            self.config.trainer.default_root_dir = root

        def after_instantiate_classes(self) -> None:
            check_layout_before_launch(self.model, self.trainer.strategy)
            check_config_before_launch(self.model, self.datamodule, self.trainer.strategy, "fit")

    # The parser settings of lightning_moe.cli.cli_main, but for the field docstrings: they are --help
    # text, which a plan never prints, and reading them parses the source of every configured class
    # (a second or two of each planning run). cli_main sets them again for itself.
    set_parsing_settings(docstring_parse_attribute_docstrings=False, instantiate_subclass_spec_in_any=False)
    overrides = [
        "--trainer.max_epochs=-1", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--trainer.num_sanity_val_steps=0", "--trainer.limit_val_batches=0",
    ]
    per_run = [f"--trainer.max_steps={measure_step + 1}", f"--trainer.default_root_dir={root}"]
    args = list(args[1:] if args[:1] == ["fit"] else args)
    # LightningCLI warns when given args while the command line has others (the plan command's own).
    with mock.patch.object(sys, "argv", sys.argv[:1]):
        return PlanCLI(L.LightningModule, L.LightningDataModule, save_config_callback=None, run=False,
                       args=[*args, *overrides, *per_run])


_parsed: dict[tuple[str, ...], Any] | None = None
"""The configurations `plan_cli` parsed, by their arguments, within `configuration_parsed_once`."""


@contextmanager
def configuration_parsed_once() -> Iterator[None]:
    """Within the body, `plan_cli` parses each configuration once (a second of jsonargparse per
    planning run saved): the later runs of this process, and of the processes it forks, take a
    copy of the first parse. A file edited meanwhile is read again only after the body."""
    global _parsed
    outer, _parsed = _parsed, {} if _parsed is None else _parsed
    try:
        yield
    finally:
        _parsed = outer


def is_memory_callback(spec: Any) -> bool:
    """Whether a configured callback (a ``class_path`` spec, or an object) is one of `MEMORY_CALLBACKS`."""
    if not hasattr(spec, "get"):
        return isinstance(spec, MEMORY_CALLBACKS)
    module_name, _, name = str(spec.get("class_path")).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(cls, type) and issubclass(cls, MEMORY_CALLBACKS)


def is_reference(cli) -> bool:
    from lightning_moe.lit import MoELanguageModel, TextDataModule

    return isinstance(cli.model, MoELanguageModel) and (cli.datamodule is None or isinstance(cli.datamodule, TextDataModule))


def data_shape(cli) -> tuple[int, int]:
    """``(seq_len, batch_size)`` of the reference data (one sequence of ``max_seq_len`` without a datamodule)."""
    data = cli.datamodule
    if data is None:
        return cli.model.config.max_seq_len, 1
    return int(data.hparams.seq_len), int(data.hparams.batch_size)
