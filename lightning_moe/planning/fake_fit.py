"""One rank's training step of a ``lightning-moe fit`` configuration, on a CPU that computes nothing.

:func:`fake_fit_rank` runs what ``lightning-moe fit`` runs: the same configuration parsed by the same
CLI, the same ``Trainer.fit`` with the configured ``MoEStrategy``, LightningModule, precision,
gradient accumulation and memory callbacks (recompute, offload), as rank ``r`` of the configured
world on torch's ``fake`` process group (`lightning_moe.planning.fake_world`). The model is built on
the meta device as always under ``MoEStrategy``; its shards are materialised under
``FakeTensorMode``, and the training step, backward and optimizer step run under it too: shapes,
dtypes and every allocation are real, no value is computed and nothing is allocated. A
`~lightning_moe.planning.step_probe.StepProbe` counts the live bytes and the collectives.

What differs from a real run, and why:

* the Trainer runs on the CPU accelerator (the planner runs where there is no GPU); a configuration
  for GPUs plans the GPU's memory: the experts take the ``grouped_mm`` kernel and attention a
  flash kernel's memory (`lightning_moe.planning.gpu_path`), and ``16-mixed`` is planned as
  ``bf16-mixed`` (the same bytes; CPU autocast has no fp16 loss scaling);
* the data: the reference model is fed synthetic batches of the configured ``batch_size`` and
  ``seq_len`` (its ``TextDataModule`` reads no corpus); any other model gets its own datamodule;
* routing: the dispatcher's one host read, the per-expert row counts, is answered as perfectly
  balanced routing times ``imbalance`` (every expert receives ``imbalance`` times its share, so the
  receiving buffers are sized for the busiest rank); the other reads are answered as on a healthy
  run (the TP ranks agree on the batch, the gradients are finite);
* logged values (``self.log``) are replaced by real zeros (a fake value has nothing to log), no
  logger, checkpoint, progress bar, summary or validation runs, and only the memory callbacks of
  the configuration are kept.

What it cannot see: GPU streams and the caching allocator (fragmentation, the reserve beyond the
allocated bytes), NCCL's own buffers, CUDA and library workspaces.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any
from unittest import mock

import lightning as L
import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_moe.compat import FakeTensor, FakeTensorMode, ModTracker, unset_fake_temporarily
from lightning_moe.layers import expert_kernels
from lightning_moe.layers.cpu_gemm import ENV_VAR as CPU_GEMM_ENV_VAR
from lightning_moe.planning.fake_objects import FakeObjects
from lightning_moe.planning.fake_world import fake_rank
from lightning_moe.planning.gpu_path import take_the_gpu_path
from lightning_moe.planning.live_bytes import follow_fsdp_resizes, storage_bytes
from lightning_moe.planning.microbatch_cut import MicrobatchCut, microbatches_cut
from lightning_moe.planning.plan_config import (
    PlanConfigError,
    callers_state_kept,
    data_shape,
    is_reference,
    plan_cli,
)
from lightning_moe.planning.rank_step import RankStep
from lightning_moe.planning.repeated_blocks import BlockCut, cut_blocks, stage_signatures
from lightning_moe.planning.step_probe import StepProbe

__all__ = ["RankStep", "fake_fit_rank"]  # RankStep lives in rank_step, kept here for callers


def fake_fit_rank(
    args: list[str], rank: int, world_size: int, *, imbalance: float = 1.0, measure_step: int = 1,
    objects: FakeObjects | None = None, cut: BlockCut | None = None, microbatches: MicrobatchCut | None = None,
) -> RankStep:
    """Run ``lightning-moe fit ARGS`` as ``rank`` of ``world_size`` on fake tensors and return what
    optimizer step ``measure_step`` (0-based; the default 1 runs with AdamW's moments) held.

    ``args``: what ``lightning-moe fit`` takes after ``fit`` (``--config`` and overrides).
    ``imbalance`` (>= 1): every expert receives this times its balanced share of rows.
    ``objects``: the object broadcasts of the ranks planned before in this process (`FakeObjects`);
    raises `AwaitsObject` when this rank needs one of a rank not planned yet.
    ``cut``: run the rank's stage with fewer blocks of its repeated kinds (`BlockCut`; None: all).
    ``microbatches``: run fewer pipeline micro-batches per step, fewer in flight (`MicrobatchCut`;
    None: as configured).
    """
    return fake_fit_steps(args, rank, world_size, imbalance=imbalance, measure_step=measure_step, objects=objects,
                          cut=cut, microbatches=None if microbatches is None else (microbatches,))[0]


def fake_fit_steps(
    args: list[str], rank: int, world_size: int, *, imbalance: float = 1.0, measure_step: int = 1,
    objects: FakeObjects | None = None, cut: BlockCut | None = None,
    microbatches: Sequence[MicrobatchCut] | None = None,
) -> list[RankStep]:
    """`fake_fit_rank` measuring several optimizer steps of one run: with ``microbatches``, one step
    per cut from ``measure_step`` on, each run with its cut (the steps before with one micro-batch,
    `WARMUP_CUT`; the cuts may only grow); without, step ``measure_step`` as configured. One setup
    serves them all, and each step starts holding what a run of its cut alone would
    (`microbatches_cut`)."""
    if imbalance < 1:
        raise PlanConfigError(f"imbalance must be >= 1 (1 = perfectly balanced routing), got {imbalance}.")
    last_step = measure_step + (len(microbatches) - 1 if microbatches else 0)
    with callers_state_kept(), fake_rank(rank, world_size), \
            tempfile.TemporaryDirectory(prefix="lightning-moe-plan-") as root:
        cli = plan_cli(args, last_step, root)
        trainer, module = cli.trainer, cli.model
        loader = _loader(cli, world_size, last_step)
        objects = FakeObjects() if objects is None else objects
        objects.new_rank()
        cut_kinds: dict[int, int] = {}
        signatures: list = []
        meter = _StepMeter(range(measure_step, last_step + 1), trainer.accumulate_grad_batches)
        trainer.callbacks.append(meter)
        with _faked_training(meter, cli.planned_for_gpu, _routing_answers(cli, imbalance), objects), \
                _blocks_cut(rank, cut, cut_kinds, signatures), microbatches_cut(microbatches, measure_step) as to_step:
            meter.to_step = to_step
            if loader is None:
                trainer.fit(module, datamodule=cli.datamodule)
            else:
                trainer.fit(module, train_dataloaders=loader)
        if len(meter.results) <= last_step - measure_step:
            raise PlanConfigError(
                f"optimizer step {measure_step + len(meter.results)} never ran (global_step={trainer.global_step}): "
                "the configured data holds fewer batches than the planner needs."
            )
        for step in meter.results:
            step.rank = rank
            step.cut_blocks = dict(cut_kinds)
            step.stage_signatures = signatures[0] if signatures else None
        return meter.results


# -- the data ------------------------------------------------------------------------------------


def _loader(cli, world_size: int, measure_step: int) -> torch.utils.data.DataLoader | None:
    """Synthetic ``(inputs, targets)`` batches of the configured shape for the reference model;
    None: fit with the configuration's own datamodule."""
    if not is_reference(cli):
        return None
    seq_len, batch_size = data_shape(cli)
    batches = (measure_step + 2) * cli.trainer.accumulate_grad_batches * world_size
    return torch.utils.data.DataLoader(_Zeros(batches * batch_size, seq_len), batch_size=batch_size)


class _Zeros(torch.utils.data.Dataset):
    def __init__(self, length: int, seq_len: int) -> None:
        self.length, self.seq_len = length, seq_len

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(self.seq_len, dtype=torch.long), torch.zeros(self.seq_len, dtype=torch.long)


def _routing_answers(cli, imbalance: float) -> dict[str, Any]:
    """The host reads of a training step, answered as on a healthy run with ``imbalance``."""
    strategy = cli.trainer.strategy
    moe = getattr(getattr(cli.model, "config", None), "moe", None)
    rows = 0
    if moe is not None and is_reference(cli):
        seq_len, batch_size = data_shape(cli)
        dims = strategy.parallel_dims(strategy.num_nodes * strategy.num_processes)
        micro_batch = batch_size // strategy.num_microbatches
        local_tokens = micro_batch * seq_len // (dims.tp * dims.cp)
        rows = math.ceil(local_tokens * moe.top_k / moe.num_experts * imbalance)
    return {
        "alltoall.py:_counts": rows,  # per (source rank, expert): what each expert receives
        "batch_agreement.py:_raise_if_disagree": False,  # the TP ranks hold the same batch
        "optimizer_step.py:check": True,  # the global gradient norm is finite
        # torch's pipeline schedule votes once whether every stage's shapes are static: they are (the
        # runner gives each stage its boundary shapes).
        "runner.py:_run_schedule": 1,  # parallel/pipeline/runner.py
    }


# -- the step ------------------------------------------------------------------------------------


class _StepMeter(L.Callback):
    """Starts the probe's record at each measured step and reads what it held (`RankStep`); between
    optimizer steps, tells ``to_step`` which step comes next (`microbatches_cut`)."""

    def __init__(self, measured: range, accumulation: int) -> None:
        self.measured, self.accumulation = measured, accumulation
        self.probe: StepProbe | None = None
        self.results: list[RankStep] = []
        self.to_step: Callable[[int], None] = lambda global_step: None
        self.fake_mode: Any = nullcontext()  # where the step's tensors are made (`_faked_training`)
        self._grads = 0

    def _measuring(self, trainer) -> bool:
        return trainer.global_step in self.measured and self.probe is not None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._measuring(trainer) and batch_idx % self.accumulation == 0:
            self.probe.new_step()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._measuring(trainer):
            self._grads = storage_bytes(p.grad for p in pl_module.parameters() if p.grad is not None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # global_step has moved on once the measured step's optimizer ran.
        done = trainer.global_step - 1
        if self.probe is not None and done in self.measured and done - self.measured.start == len(self.results):
            record = self.probe.new_step()
            states = [t for optimizer in trainer.optimizers for state in optimizer.state.values()
                      for t in state.values() if isinstance(t, torch.Tensor)]
            self.results.append(RankStep(
                rank=-1, params_bytes=storage_bytes(pl_module.parameters()), grads_bytes=self._grads,
                optimizer_bytes=storage_bytes(states), peak_bytes=record.peak_bytes, start_bytes=record.start_bytes,
                dispatch_bytes=record.peak_dispatch_bytes, phase_peaks=dict(record.phase_peaks),
                collectives=list(record.collectives), host_reads=len(record.host_reads),
            ))
        with self.fake_mode:  # what it makes for the next step is made as the step makes it: fake
            self.to_step(trainer.global_step)


@contextmanager
def _blocks_cut(rank: int, cut: BlockCut | None, found: dict[int, int], signatures: list) -> Iterator[None]:
    """Cut the rank's blocks (`cut_blocks`) when the strategy sets the model up, before it splits or
    shards it; ``found`` gets the kinds cut, ``signatures`` every stage's `stage_signatures`."""
    if cut is None:
        yield
        return
    from lightning_moe.strategies import moe_strategy

    real_setup = moe_strategy.MoEStrategy.setup

    def setup(self, trainer) -> None:
        pipeline = self._pipeline
        dims = self.parallel_dims(self.num_nodes * self.num_processes)
        virtual, layer_split = (1, None) if pipeline is None else (pipeline.virtual_stages, pipeline.layer_split)
        signatures.append(stage_signatures(self.lightning_module, dims.pp, virtual, layer_split))
        kinds, split = cut_blocks(self.lightning_module, dims.coords(rank).pp, dims.pp, virtual, layer_split, cut)
        if pipeline is not None:
            pipeline.layer_split = split
        found.update(kinds)
        real_setup(self, trainer)

    with mock.patch.object(moe_strategy.MoEStrategy, "setup", setup):
        yield


def _unfaked(real):
    """``real`` run with fake tensor modes set aside (it builds host tensors that must hold values)."""

    def run(*args, **kwargs):
        with unset_fake_temporarily():
            return real(*args, **kwargs)

    return run


@contextmanager
def _faked_training(meter: _StepMeter, gpu: bool, answers: dict[str, Any], objects: FakeObjects) -> Iterator[None]:
    """Patch ``MoEStrategy`` so that the model's tensors are fake from materialisation on, and the
    step, backward and optimizer step run under ``FakeTensorMode``, watched by a `StepProbe`."""
    from lightning_moe.strategies import model_setup, moe_strategy

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    meter.fake_mode = fake
    tracker = ModTracker()
    probe = StepProbe(answers, tracker)
    strategy_cls = moe_strategy.MoEStrategy
    real_materialize = moe_strategy.materialize

    with ExitStack() as stack:

        def materialize(model, device, *args, **kwargs):
            with fake:
                real_materialize(model, device, *args, **kwargs)
            if gpu:
                take_the_gpu_path(model)
            # From here on every storage made is counted; the shards are counted as held.
            stack.enter_context(tracker)
            stack.enter_context(probe)
            stack.enter_context(probe.patched())
            stack.enter_context(follow_fsdp_resizes(probe))
            probe.adopt([*model.parameters(), *model.buffers()])
            meter.probe = probe

        def faked(name: str):
            real = getattr(strategy_cls, name)

            def run(self, *args, **kwargs):
                with fake:
                    return real(self, *args, **kwargs)

            return mock.patch.object(strategy_cls, name, run)

        real_log = L.LightningModule.log

        def log(self, name, value, *args, **kwargs):
            if isinstance(value, FakeTensor):
                with unset_fake_temporarily():
                    value = torch.zeros((), dtype=value.dtype)
            with unset_fake_temporarily():
                return real_log(self, name, value, *args, **kwargs)

        if gpu:  # the experts compute in bf16 under autocast as on a GPU (a CPU does only with bf16 units)
            stack.enter_context(mock.patch.object(expert_kernels, "cpu_has_bf16_units", lambda: True))
        def faked_function(module, name: str):
            real = getattr(module, name)

            def run(*args, **kwargs):
                with fake:
                    return real(*args, **kwargs)

            return mock.patch.object(module, name, run)

        for patch in (
            # Under PP the model is materialised (then sharded) before the strategy's own call.
            faked_function(model_setup, "materialize"), faked_function(model_setup, "shard_split_model"),
            mock.patch.object(moe_strategy, "materialize", materialize),
            # GradSync computes each DTensor's block offsets with host tensors (torch's helper),
            # which a fake mode would make valueless.
            mock.patch.object(moe_strategy, "make_grad_sync", _unfaked(moe_strategy.make_grad_sync)),
            # FSDP2 builds device meshes while a stage is sharded (under fake): dp x cp flattened, dp
            # joined to a parameter's tp mesh. A mesh finds this rank's coordinates in a host tensor
            # of ranks (nonzero), which a fake mode cannot answer: it is layout, not memory.
            mock.patch.object(DeviceMesh, "__init__", _unfaked(DeviceMesh.__init__)),
            # Fake tensors are on the CPU already (and cannot be swapped into a module by .to()).
            mock.patch.object(strategy_cls, "model_to_device", lambda self: None),
            mock.patch.object(L.LightningModule, "log", log),
            # A fake broadcast sends nothing (the receivers would unpickle garbage): every rank of a
            # fake world keeps what it computed itself, the same as the source's (seeds, paths).
            mock.patch.object(strategy_cls, "broadcast", lambda self, obj, src=0: obj),
            mock.patch.object(torch.distributed, "broadcast_object_list", objects.broadcast_object_list),
            # The CPU's expert GEMM library is measured on rank 0 and sent to all: no memory of its own.
            mock.patch.dict(os.environ, {CPU_GEMM_ENV_VAR: "aten"}),
            faked("training_step"), faked("backward"), faked("optimizer_step"),
        ):
            stack.enter_context(patch)
        yield

