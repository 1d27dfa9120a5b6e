"""The memory one rank holds during a real training step: `StepMemoryMeter`, and `measure_fit`,
which runs a ``lightning-moe fit`` configuration on forked gloo ranks with the meter.

What is measured, for the optimizer step whose index is ``measure_step`` (default 1: the second
step, so AdamW's moments exist), in bytes of distinct tensor storages on this rank (a DTensor:
its local tensor; a view counts its whole storage, once):

* ``params_bytes``: the storages behind the module's parameters (FSDP2's sharded parameters are
  DTensors too: their local shards, padding included);
* ``grads_bytes``: the storages behind the parameters' ``.grad``, read in
  ``on_before_optimizer_step`` of that step (gradients reduced, before the update). Under
  ``GradSync`` every gradient is a view of its bucket: the whole bucket counts, including the one
  flag element per parameter that follows the gradient slots;
* ``optimizer_bytes``: the storages of every tensor in ``optimizer.state`` after that step
  (AdamW: ``exp_avg``, ``exp_avg_sq``, and ``step``, a scalar tensor of its own per parameter);
* ``peak_bytes``: the largest live bytes from ``on_train_batch_start`` of the step's first
  micro-batch to ``on_train_batch_end`` of its last (a pipeline schedule runs inside one
  ``training_step``). The counter starts at what the rank holds: the storages of the parameters,
  their gradients, the gradient-sync buckets, the optimizer states, the module's buffers, the
  batch, and the tensors the pipeline schedules keep (receive buffers); it then adds every
  storage an op creates until it is freed (`helpers.live_bytes.LiveBytes`);
* ``activation_bytes`` := ``peak_bytes - params_bytes - grads_bytes - optimizer_bytes``:
  everything else live at the peak (activations, temporaries, buffers, the batch). A planner that
  predicts these five numbers must use the same definition.

Counting details: DTensor ops are let through to DTensor (the counter returns ``NotImplemented``
for them, as torch's ``CommDebugMode`` does), so the local ops a DTensor op runs, and the
temporaries of its redistributions, are counted as they are made. FSDP2 allocates and frees its
unsharded parameters by resizing storages (``alloc_storage``/``free_storage``, no op the dispatcher
sees): while the counter is active those two functions are wrapped to add and remove the bytes.

What it cannot see: memory an op uses inside and frees before returning (kernel workspaces),
storages made on other threads without an op (a collective's internal buffers), allocator
caching and fragmentation, and tensors the loop keeps that none of the holders above reaches
(a prefetched next batch).
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import types
from collections.abc import Iterable, Iterator
from typing import Any
from unittest import mock

import lightning as L
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor

from helpers.dist import run_distributed
from helpers.memory import storage_bytes, tensors_in
from lightning_moe.planning.live_bytes import LiveBytes, follow_fsdp_resizes
from lightning_moe.planning.plan_config import plan_cli

__all__ = ["MEASURED_KEYS", "TINY_LAYOUTS", "StepMemoryMeter", "exactly_balanced_routing", "measure_fit"]

MEASURED_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "peak_bytes", "activation_bytes")
"""The keys of `StepMemoryMeter.measured`."""

_S = "--trainer.strategy.init_args."
TINY_LAYOUTS = {
    "tp2-ep4": [],  # the configuration as it is
    "pp2-ep2": [f"{_S}pipeline_parallel_size=2", f"{_S}num_microbatches=2", f"{_S}tensor_parallel_size=1",
                f"{_S}expert_parallel_size=2"],
    "cp2-ep2": [f"{_S}context_parallel_size=2", f"{_S}tensor_parallel_size=1", f"{_S}expert_parallel_size=2"],
    "full-shard-ep4": [f"{_S}sharding_strategy=FULL_SHARD", f"{_S}tensor_parallel_size=1"],
}
"""Four layouts of ``examples/configs/tiny_cpu.yaml`` on 4 ranks (overrides of its strategy) in which a
plan is compared with a measured run (``tests/planning/test_plan_vs_measured.py``,
``benchmarks/plan_vs_measured.py``)."""


# Objects whose tensors are counted through other holders, or that lead to data the step does not
# hold on its device (the datamodule's token arrays): the walk for kept tensors stops there.
_WALK_STOPS = (nn.Module, L.Trainer, L.LightningDataModule, torch.utils.data.DataLoader, type, types.ModuleType,
               types.FunctionType, types.MethodType, types.BuiltinFunctionType)
_WALK_LIMIT = 200_000  # objects visited at most per root (a pipeline schedule holds a few thousand)


class _StepLiveBytes(LiveBytes):
    """`LiveBytes` that lets DTensor ops through and follows storage resizes (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs its local ops (and redistributions) through this mode
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _count(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, FakeTensor):
            return  # DTensor's shape propagation: nothing is allocated
        super()._count(tensor)

    def forget(self, tensor: torch.Tensor) -> None:
        """Stop counting ``tensor``'s storage (it is alive, but not what the step holds)."""
        key = tensor.untyped_storage()._cdata
        with self._lock:
            if key in self._alive:
                self._alive.discard(key)
                self.live -= self._sizes.pop(key, 0)


def _dataset_tensors(trainer) -> list[torch.Tensor]:
    """The training data's host tensors (a token stream): data on the host, not what a device holds."""
    loaders = trainer.train_dataloader
    loaders = getattr(loaders, "flattened", None) or ([loaders] if loaders is not None else [])
    found = []
    for loader in loaders:
        dataset = getattr(loader, "dataset", None)
        while dataset is not None:
            found += [value for value in vars(dataset).values() if isinstance(value, torch.Tensor)]
            dataset = getattr(dataset, "dataset", None)
    return found


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _real(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in tensors if t.device.type != "meta" and not isinstance(t, FakeTensor)]


def _state_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Every tensor of the optimizers' per-parameter states (local tensors)."""
    return [_local(v) for opt in optimizers for state in opt.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def _kept_tensors(root: Any) -> list[torch.Tensor]:
    """Tensors reachable from ``root`` through containers and plain objects (not through modules,
    the Trainer, data or code: `_WALK_STOPS`)."""
    found, seen, todo = [], {id(root)}, [root]
    while todo and len(seen) < _WALK_LIMIT:
        obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            continue
        if isinstance(obj, _WALK_STOPS):
            continue
        for ref in gc.get_referents(obj):
            if id(ref) not in seen and not isinstance(ref, (str, bytes, int, float)):
                seen.add(id(ref))
                todo.append(ref)
    return found


class StepMemoryMeter(L.Callback):
    """Measures what this rank holds during optimizer step ``measure_step`` of ``Trainer.fit``
    (module docstring: the five numbers and their definitions, ``activation_bytes`` included).

    After the step, `measured` holds ``params_bytes``, ``grads_bytes``, ``optimizer_bytes``,
    ``peak_bytes`` and ``activation_bytes`` (ints); until then it is None. The fit must run at
    least ``measure_step + 1`` optimizer steps.
    """

    def __init__(self, measure_step: int = 1) -> None:
        if measure_step < 0:
            raise ValueError(f"measure_step={measure_step}: the index of an optimizer step is 0 or more.")
        self.measure_step = measure_step
        self.measured: dict[str, int] | None = None
        self._counter: _StepLiveBytes | None = None
        self._resizes: contextlib.ExitStack | None = None
        self._grads_bytes = 0
        self._window = False

    def _held(self, trainer, pl_module, batch) -> list[torch.Tensor]:
        strategy = trainer.strategy
        params = list(pl_module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        kept = [*_kept_tensors(getattr(strategy, "_grad_sync", None)), *_kept_tensors(getattr(strategy, "_pipeline", None))]
        return _real([*params, *grads, *pl_module.buffers(), *_state_tensors(trainer.optimizers),
                      *tensors_in(batch), *kept])

    def on_train_start(self, trainer, pl_module) -> None:
        """Start counting before the first step: every storage made from here on is seen being made
        (pipeline schedules and their buffers, gradient buckets, optimizer states), so the measured
        step starts from all the rank holds, not only from what a walk of the holders finds."""
        counter = _StepLiveBytes()
        for tensor in self._held(trainer, pl_module, ()):
            counter._count(tensor)
        self._resizes = contextlib.ExitStack()
        self._resizes.enter_context(follow_fsdp_resizes(counter))
        counter.__enter__()
        self._counter = counter

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        """The measured step's window opens at its first micro-batch: its peak starts at what is held."""
        if self._counter is None or self._window or trainer.global_step != self.measure_step:
            return
        for tensor in tensors_in(batch):
            self._counter._count(tensor)
        for tensor in _dataset_tensors(trainer):  # made while counting (the loader's first epoch)
            self._counter.forget(tensor)
        self._counter.peak = self._counter.live
        self._window = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        """Read the gradients' storages: reduced, not yet applied."""
        if not self._window:
            return
        grads = [_local(p.grad) for p in pl_module.parameters() if p.grad is not None]
        self._grads_bytes = max(self._grads_bytes, storage_bytes(_real(grads)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """Stop after the measured step's last micro-batch (the optimizer has stepped)."""
        if not self._window or self.measured is not None or trainer.global_step != self.measure_step + 1:
            return
        peak = self._stop()
        params = storage_bytes(_real(_local(p) for p in pl_module.parameters()))
        optimizer = storage_bytes(_real(_state_tensors(trainer.optimizers)))
        self.measured = {
            "params_bytes": params, "grads_bytes": self._grads_bytes, "optimizer_bytes": optimizer, "peak_bytes": peak,
            "activation_bytes": peak - params - self._grads_bytes - optimizer,
        }

    def _stop(self) -> int:
        counter, self._counter = self._counter, None
        assert counter is not None and self._resizes is not None
        counter.__exit__(None, None, None)
        self._resizes.close()
        self._resizes = None
        return counter.peak

    def on_exception(self, trainer, pl_module, exception) -> None:
        """Leave the dispatch mode and FSDP2's functions as they were."""
        if self._counter is not None:
            self._stop()

    def teardown(self, trainer, pl_module, stage) -> None:
        """A step that never ended (the fit stopped inside it) leaves nothing active; `measured` stays None."""
        if self._counter is not None:
            self._stop()


@contextlib.contextmanager
def exactly_balanced_routing(top_k: int) -> Iterator[None]:
    """Routers configured with ``force_load_balancing`` route exactly balanced instead of randomly:
    local token ``t`` goes to experts ``(t * top_k + j) % num_experts``, ``j < top_k`` (with a
    straight-through gradient, as the random logits have), so every expert gets the same rows from
    every rank whenever ``tokens * top_k`` is a multiple of ``num_experts``: the routing a planner
    assumes at ``imbalance=1``."""
    from lightning_moe.layers import router

    def balanced(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        tokens, experts = logits.shape
        index = torch.arange(tokens, device=logits.device)
        offset = (index * top_k) % experts
        # Expert (offset + j) % E scores -j: the top-k are exactly offset .. offset + k - 1.
        rank = (torch.arange(experts, device=logits.device)[None, :] - offset[:, None]) % experts
        pattern = -rank.to(logits.dtype)
        return logits + (pattern - logits).detach()

    with mock.patch.object(router, "random_logits_straight_through", balanced):
        yield


def _fit_rank(rank: int, world_size: int, args: list[str], measure_step: int, root: str, balanced: bool) -> dict[str, int]:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    os.chdir(root)  # anything written relative to the working directory stays in the temporary folder
    # fit's parser and checks, shortened as the planner shortens it, on the configured accelerator.
    cli = plan_cli([*args, f"--trainer.devices={world_size}", "--trainer.num_nodes=1"], measure_step, root, on_cpu=False)
    meter = StepMemoryMeter(measure_step)
    cli.trainer.callbacks.append(meter)
    with exactly_balanced_routing(cli.model.config.moe.top_k) if balanced else contextlib.nullcontext():
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if meter.measured is None:
        raise RuntimeError(
            f"Rank {rank}: optimizer step {measure_step} was never completed (global_step={cli.trainer.global_step}); "
            "the configuration's data may be shorter than measure_step + 1 optimizer steps."
        )
    return meter.measured


def measure_fit(
    args: list[str], world_size: int, measure_step: int = 1, timeout_s: float = 600.0, balanced_routing: bool = False
) -> list[dict[str, int]]:
    """`StepMemoryMeter.measured` of every rank (rank order) for ``lightning-moe fit ARGS`` on
    ``world_size`` forked gloo ranks (one intra-op thread each).

    ``args`` as the CLI takes them after ``fit`` (a leading ``"fit"`` is dropped), e.g.
    ``["--config", "examples/configs/tiny_cpu.yaml", "--trainer.strategy.init_args.pipeline_parallel_size=2"]``.
    The run is shortened to a measurement: ``devices=world_size``, ``max_steps = measure_step + 1``,
    no logger, checkpointing, progress bar, model summary, sanity or other validation; the
    configuration's callbacks are dropped except `lightning_moe.planning.plan_config.MEMORY_CALLBACKS`
    (the planner's `plan_cli`, on the configured accelerator). Relative paths in ``args`` are
    resolved from the current directory. ``balanced_routing``: the reference model's routers
    route exactly balanced (`exactly_balanced_routing`; sets ``model.moe.force_load_balancing``).
    """
    args = list(args[1:] if args[:1] == ["fit"] else args)
    args = [_absolute_config(a) for a in args]
    if balanced_routing:
        args.append("--model.model.moe.force_load_balancing=true")
    with tempfile.TemporaryDirectory(prefix="measure_fit-") as root:
        return run_distributed(
            _fit_rank, world_size, args, measure_step, root, balanced_routing, timeout_s=timeout_s, tmp_dir=root
        )


def _absolute_config(arg: str) -> str:
    """``--config=PATH`` / a bare path after ``--config``: absolute, since the ranks change directory."""
    if arg.startswith("--config="):
        return "--config=" + os.path.abspath(arg.split("=", 1)[1])
    return os.path.abspath(arg) if os.path.isfile(arg) and arg.endswith((".yaml", ".yml")) else arg

