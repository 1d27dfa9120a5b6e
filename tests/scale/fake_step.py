"""A training step of a real preset on one fake rank, watched by `scale.step_probe.StepProbe`.

`run_fake_steps` builds a preset on the meta device, parallelises it as rank ``r`` of a layout on
the fake backend (`scale.fake_world`), materialises it under ``FakeTensorMode`` (shapes and
dtypes are real, no storage is allocated, no value is computed) and runs optimizer steps as
``MoEStrategy`` runs them under automatic optimization and ``bf16-mixed``: per micro-batch the
tensor-parallel batch check (:class:`~lightning_moe.strategies.step_safeguards.StepSafeguards`),
forward and loss under autocast, the aux-loss gradient scale, backward with the bucketed gradient
reduction armed (:class:`~lightning_moe.parallel.grad_sync.GradSync`, reduced after the last
micro-batch); then the batch verification, the finite-gradient guard (global gradient norm),
``AdamW.step`` under :func:`~lightning_moe.parallel.allow_mixed_tensors` and ``zero_grad()``.
NO_SHARD data parallelism, the ``alltoall`` dispatcher, dropless, forced-balanced routing.

The model takes the path it takes on an H100/H200 (`lightning_moe.planning.gpu_path.take_the_gpu_path`): ``grouped_mm`` experts
that save their activation, and flash attention's memory; ``AdamW`` runs ``fused``, what
``MoELanguageModel`` asks for on CUDA. Where this differs from a GPU run:

* GradSync is built outside ``FakeTensorMode``: it computes each DTensor's block offsets once with
  torch's helper, whose host tensors a fake mode would make valueless;
* a fake tensor's ``data_ptr()`` is 0, which GradSync's check for a gradient already in its bucket
  relies on: the probe gives fake tensors distinct addresses (``step_probe._fake_data_ptr``);
* CPU autocast leaves attention and some reductions in fp32 where CUDA autocast runs bf16, and the
  experts compute in bf16 only on CPUs with bf16 units: ``cpu_has_bf16_units`` is patched true
  (nothing is computed).

Also what `scale.step_probe` cannot see (streams, NCCL, the allocator).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from scale.fake_save import measure_checkpoint_save
from scale.fake_world import Sharded, sharded_preset
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.mod_tracker import ModTracker

from lightning_moe.layers import expert_kernels
from lightning_moe.lit.optimization import adamw_kernel_options
from lightning_moe.models import MoETransformerConfig
from lightning_moe.parallel import ParallelDims, allow_mixed_tensors
from lightning_moe.parallel.grad_sync import GradSync
from lightning_moe.planning.fake_world import fake_rank
from lightning_moe.planning.gpu_path import take_the_gpu_path
from lightning_moe.planning.step_probe import StepProbe, StepRecord
from lightning_moe.strategies.model_setup import materialize
from lightning_moe.strategies.step_safeguards import StepSafeguards

__all__ = ["FakeRun", "balanced_rows", "default_answers", "load_config", "run_fake_steps"]


def balanced_rows(config: MoETransformerConfig, local_tokens: int) -> int:
    """Rows each expert gets from one rank's ``local_tokens`` under perfectly balanced routing."""
    moe = config.moe
    if (local_tokens * moe.top_k) % moe.num_experts:
        raise ValueError(f"{local_tokens} tokens x top-{moe.top_k} do not spread evenly over {moe.num_experts} experts")
    return local_tokens * moe.top_k // moe.num_experts


@dataclass
class FakeRun:
    """The records of `run_fake_steps`, one per optimizer step, and what was parallelised."""

    sharded: Sharded
    steps: list[StepRecord]
    local_tokens: int
    save: StepRecord | None = None
    """Saving a sharded checkpoint after the steps (``save_checkpoint=True``), see `scale.fake_save`."""
    save_written_bytes: int = 0
    """Bytes that save would write."""


def run_fake_steps(
    name: str,
    dims: ParallelDims,
    rank: int,
    seq_len: int,
    micro_batches: int = 2,
    steps: int = 2,
    batch_size: int = 1,
    answers: Callable[[MoETransformerConfig, int], Mapping[str, Any]] | None = None,
    save_checkpoint: bool = False,
    **overrides: Any,
) -> FakeRun:
    """Run ``steps`` optimizer steps of ``micro_batches`` micro-batches of preset ``name`` as ``rank``.

    ``overrides`` replace fields of the preset's config (e.g. ``num_layers=2``); routing is forced
    balanced (``moe.force_load_balancing``). ``answers(config, local_tokens)`` gives the host reads'
    answers (default: `default_answers`). ``save_checkpoint``: then save a sharded checkpoint
    (`scale.fake_save.measure_checkpoint_save`), recorded apart in ``FakeRun.save``.
    """
    config = load_config(name, **overrides)
    local_tokens = batch_size * seq_len // dims.tp  # sequence parallel: each TP rank routes its slice
    with fake_rank(rank, dims.world_size):
        sharded = sharded_preset(name, dims, rank, config=config)
        model, ctx = sharded.model, sharded.ctx
        tracker = ModTracker()
        probe = StepProbe((answers or default_answers)(config, local_tokens), tracker)
        take_the_gpu_path(model)
        with FakeTensorMode(allow_non_fake_inputs=True):
            materialize(model, torch.device("cpu"))
            # One bucket per reduce group: one all-reduce each, whatever the bucket cap would cut.
            # Built outside the fake mode: it computes each DTensor's block offsets once, with
            # host tensors (torch's helper) that a fake mode would make valueless.
            with unset_fake_temporarily():
                sync = GradSync(model, ctx, bucket_size_mb=2.0**40, explicit_backward=True)
            safeguards = StepSafeguards()
            safeguards.setup(model, ctx, torch.device("cpu"), None, False)
            # Fused, as MoELanguageModel asks on CUDA; MoEStrategy's allow_mixed_tensors lets it step
            # the mix of DTensors and plain tensors.
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **adamw_kernel_options({"cuda"}))
            saved = _SavedBytes(model, probe)
            records = []
            # The experts compute in bf16 under autocast as on a GPU (on a CPU without bf16 units
            # they would stay fp32; nothing is computed here anyway).
            with tracker, probe, probe.patched(), \
                    mock.patch.object(expert_kernels, "cpu_has_bf16_units", lambda: True):
                probe.adopt([*model.parameters(), *model.buffers()])
                probe.new_step()
                for step in range(steps):
                    _one_step(model, ctx, sync, safeguards, optimizer, step, micro_batches, batch_size, seq_len,
                              probe, saved)
                    records.append(probe.new_step())
                    saved.finish(records[-1])
                save = measure_checkpoint_save(model, ctx, optimizer, probe) if save_checkpoint else (None, 0)
            for handle in saved.handles:
                handle.remove()
        sync.remove_hooks()
    return FakeRun(sharded, records, local_tokens, *save)


def load_config(name: str, **overrides: Any) -> MoETransformerConfig:
    """Preset ``name`` with ``overrides`` and forced balanced routing."""
    from models.test_presets import load_preset

    config = dataclasses.replace(load_preset(name), **overrides)
    return dataclasses.replace(config, moe=dataclasses.replace(config.moe, force_load_balancing=True))


def default_answers(config: MoETransformerConfig, local_tokens: int) -> dict[str, Any]:
    """The host reads a dropless ``alltoall`` step makes, answered as on a healthy, balanced run."""
    return {
        # The per-(rank, expert) counts gathered over ETP x EP: every one is the balanced share.
        "alltoall.py:_counts": balanced_rows(config, local_tokens),
        "batch_agreement.py:_raise_if_disagree": False,  # the TP ranks hold the same batch
        "optimizer_step.py:check": True,  # the global gradient norm is finite
    }


def _bf16_mixed() -> torch.autocast:
    """Lightning's bf16-mixed forward context (autocast around forward and loss, its weight-cast
    cache cleared after each micro-batch), on the CPU."""
    return torch.autocast("cpu", dtype=torch.bfloat16)


class _SavedBytes:
    """Live bytes gained by the blocks (embedding output to final norm input) and by the head and
    loss (final norm input to the loss) in the first micro-batch of a step."""

    def __init__(self, model: torch.nn.Module, probe: StepProbe) -> None:
        self.probe, self.marks = probe, {}
        self.handles = [
            model.embed.register_forward_hook(lambda *_: self._mark("embedded")),
            model.norm.register_forward_pre_hook(lambda *_: self._mark("blocks_done")),
        ]

    def _mark(self, name: str) -> None:
        self.marks.setdefault(name, self.probe.live)

    def loss_done(self) -> None:
        """Call once the loss of a micro-batch is computed."""
        self._mark("loss_done")

    def finish(self, record: StepRecord) -> None:
        """Write the step's measurements into ``record`` and start over."""
        marks, self.marks = self.marks, {}
        record.blocks_saved_bytes = marks["blocks_done"] - marks["embedded"]
        record.head_saved_bytes = marks["loss_done"] - marks["blocks_done"]


def _one_step(model, ctx, sync, safeguards, optimizer, step, micro_batches, batch_size, seq_len, probe, saved) -> None:
    """What ``MoEStrategy`` runs for one optimizer step under automatic optimization."""
    probe.phase = "micro-batch"
    for micro in range(micro_batches):
        tokens = torch.zeros(batch_size, seq_len, dtype=torch.long)
        safeguards.observe_batch((tokens,), {}, ctx)
        with _bf16_mixed():
            loss = model.loss(tokens, tokens) / micro_batches  # Lightning divides by the accumulation
        saved.loss_done()
        safeguards.before_backward(micro_batches, ctx, None)
        last = micro == micro_batches - 1
        sync.begin_backward()
        if last:
            loss.backward()
        else:
            with sync.no_sync():
                loss.backward()
        sync.end_backward()
        if last:
            sync.finish()
        del loss
    safeguards.verify_batches()
    probe.phase = "optimizer"
    assert safeguards.before_optimizer_step(optimizer, ctx, step, None, log=lambda *_: None)
    with allow_mixed_tensors():  # as MoEStrategy.optimizer_step runs the update
        optimizer.step()
    optimizer.zero_grad()  # set_to_none=True, Lightning's default
