"""Consolidated checkpoints (``save_distributed_checkpoint=False``) hold one tensor at a time.

On 2 ranks a toy model of six MoE layers is fitted for one epoch and saved as one consolidated
file, then a second fit resumes from it, at two layouts: EP=2 (experts split by expert) and
EP=1 under ``FULL_SHARD`` (dense weights split over DP, every expert split on its hidden
dimension over EDP=2, so pieces are cut along an inner dimension). :class:`helpers.memory.HeldBytes`
measures, on each rank, the peak bytes of tensor storages the save and the load hold beyond the
model, its optimizer and the checkpoint dict Lightning hands over. Bounds, with ``T`` the largest
tensor of the single-device state dict:

* save: rank 0 at most ``2 T`` (the full tensor it assembles and one piece it receives), rank 1
  at most ``T``; the whole model is several times ``T``;
* load: at most ``T`` (every rank maps the file and copies its slices from the mapping into its
  parameters; under ``FULL_SHARD`` the experts' load hook makes the rank's blocks of one layer
  contiguous first, less than ``T`` here).

Oracles: the file, read with ``torch.load(weights_only=True)``, holds exactly the weights the ranks
held at the end of the epoch (reassembled by ``strategies.toy.full_tensors``, not by the strategy)
and loads with ``strict=True`` into the single-device model; the resumed fit starts from them.
The page cache of a memory-mapped file is not counted (it is the kernel's, shared by the ranks of
a node); ``benchmarks/gpu_check.sh`` should check the CUDA side (rank 0's
``torch.cuda.max_memory_allocated`` during a consolidated save stays within ``2 T`` above the model).
"""

from __future__ import annotations

import errno
import re
import resource
import signal
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from helpers.memory import HeldBytes, tensors_in
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from strategies.toy import (
    LOCAL_BATCH,
    ToyModule,
    full_tensors,
    make_config,
    make_dataset,
    quiet_trainer_kwargs,
    train_loader,
)
from torch import Tensor, nn

from lightning_moe import MoELayer
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

WORLD = 2
LAYERS = 6
HIDDEN, FFN, EXPERTS = 16, 32, 4
FILE_SIZE_LIMIT = 32 << 10
"""Bytes: a few of the model's tensors (the whole file is ~150 KiB), so the write fails part-way."""
LAYOUTS = {"ep2": dict(expert_parallel_size=2), "full_shard": dict(expert_parallel_size=1, sharding_strategy="FULL_SHARD")}


class DeepNet(nn.Module):
    """Linear in, ``LAYERS`` residual MoE layers, linear head: many tensors, none dominant."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.inp = nn.Linear(6, HIDDEN)
        config = make_config(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=EXPERTS)
        self.layers = nn.ModuleList(MoELayer(config) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


class DeepModule(ToyModule):
    """The toy LightningModule around :class:`DeepNet`."""

    def __init__(self) -> None:
        super().__init__()
        self.net = DeepNet()


def largest_tensor_bytes() -> int:
    return max(t.numel() * t.element_size() for t in DeepModule().state_dict().values())


class Weights(Callback):
    """The full weights at the end of each epoch and at the start of training (after a load)."""

    def __init__(self) -> None:
        self.end: dict = {}
        self.start: dict = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = full_tensors(pl_module, dict(pl_module.named_parameters()))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.end = full_tensors(pl_module, dict(pl_module.named_parameters()))


def _measured(strategy: MoEStrategy, peaks: dict) -> MoEStrategy:
    """Wrap the strategy's checkpoint save and load in a :class:`HeldBytes` each."""
    checkpointing = strategy.checkpointing
    save, load = checkpointing.save, checkpointing.load

    def held(extra) -> list[Tensor]:
        module = strategy.lightning_module
        optimizer_state = [o.state for o in strategy.optimizers]
        return [*tensors_in(list(module.parameters())), *tensors_in(list(module.buffers())), *tensors_in(optimizer_state),
                *tensors_in(extra)]

    def measured_save(checkpoint, path):
        with HeldBytes(held(checkpoint)) as counter:
            save(checkpoint, path)
        peaks["save"] = counter.peak

    def measured_load(path, weights_only=None):
        with HeldBytes(held([])) as counter:
            out = load(path, weights_only)
        peaks["load"] = counter.peak
        return out

    checkpointing.save, checkpointing.load = measured_save, measured_load
    return strategy


def _fit(layout: str, ckpt_dir: Path, epochs: int, resume: Path | None = None, callbacks: list | None = None) -> dict:
    peaks: dict = {}
    weights = Weights()
    strategy = _measured(MoEStrategy(save_distributed_checkpoint=False, **LAYOUTS[layout]), peaks)
    callbacks = [weights, *(callbacks or [])]
    callbacks += [] if resume else [ModelCheckpoint(dirpath=ckpt_dir, filename="consolidated")]
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=WORLD, strategy=strategy, max_epochs=epochs, callbacks=callbacks,
                                               enable_checkpointing=resume is None))
    module = DeepModule()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*consolidated checkpoint: it holds the model weights only")
        trainer.fit(module, train_loader(make_dataset(WORLD * LOCAL_BATCH)), ckpt_path=resume)
    return {"peaks": peaks, "end": weights.end, "start": weights.start}


class FileSizeLimit(Callback):
    """At the end of the epoch (before ModelCheckpoint, which Lightning runs last), writing a regular
    file past ``FILE_SIZE_LIMIT`` starts failing with EFBIG, as a full disk fails with ENOSPC."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, resource.RLIM_INFINITY))


def _save_fails(root: Path) -> str:
    """The error each rank gets when rank 0's write fails half-way through the tensors."""
    try:
        _fit("ep2", root, epochs=1, callbacks=[FileSizeLimit()])
    except OSError as err:
        return str(err)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    return "no error"


def _save_and_resume(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for layout in LAYOUTS:
        ckpt_dir = Path(root) / layout
        saved = _fit(layout, ckpt_dir, epochs=1)
        resumed = _fit(layout, ckpt_dir, epochs=2, resume=ckpt_dir / "consolidated.ckpt")
        out[layout] = {"saved": saved, "resumed": resumed, "file": str(ckpt_dir / "consolidated.ckpt")}
    out["failed_write"] = _save_fails(Path(root) / "failing")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("consolidated")
    return run_distributed(_save_and_resume, WORLD, str(root), timeout_s=240, tmp_dir=root)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_consolidated_save_holds_at_most_one_full_tensor_per_rank(runs, layout):
    largest = largest_tensor_bytes()
    model_bytes = sum(t.numel() * t.element_size() for t in DeepModule().state_dict().values())
    assert model_bytes > 4 * largest  # the bound below is far from the whole model
    for rank, result in enumerate(runs):
        peak = result[layout]["saved"]["peaks"]["save"]
        bound = 2 * largest if rank == 0 else largest
        assert peak <= bound, (
            f"{layout} rank {rank}: the consolidated save held {peak} bytes beyond the model; at most {bound} "
            f"(largest tensor {largest}, whole model {model_bytes})"
        )


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_consolidated_load_reads_the_file_mapped_and_holds_one_tensor_at_most(runs, layout):
    largest = largest_tensor_bytes()
    for rank, result in enumerate(runs):
        peak = result[layout]["resumed"]["peaks"]["load"]
        assert peak <= largest, f"{layout} rank {rank}: the consolidated load held {peak} bytes; at most {largest}"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_consolidated_file_is_the_single_device_state_dict(runs, layout):
    expected = runs[0][layout]["saved"]["end"]
    state = torch.load(runs[0][layout]["file"], weights_only=True)["state_dict"]
    public = DeepModule().state_dict()
    assert sorted(state) == sorted(public)
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in state.values())
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in public.items()}
    for name, value in expected.items():  # parameters as stored; the file has the public shapes (gated fc1 [E, 2, F, H])
        torch.testing.assert_close(state[name].reshape(value.shape), value, rtol=0, atol=0,
                                   msg=lambda m, n=name: f"{layout} {n}: {m}")
    DeepModule().load_state_dict(state, strict=True)
    for rank, result in enumerate(runs):
        for name, value in expected.items():
            torch.testing.assert_close(result[layout]["resumed"]["start"][name], value, rtol=0, atol=0,
                                       msg=lambda m, n=name, r=rank: f"{layout} rank {r} resumed {n}: {m}")


def test_failed_consolidated_write_raises_on_every_rank_naming_the_file(runs, tmp_path):
    """Rank 0 stops writing at the failure but keeps receiving, so no rank waits forever in a send;
    every rank raises the error, with the errno and the checkpoint's path."""
    failing = re.escape(str(Path(runs[0]["ep2"]["file"]).parent.parent / "failing" / "consolidated.ckpt"))
    for rank, result in enumerate(runs):
        assert re.match(rf"\[Errno {errno.EFBIG}\] Could not write the checkpoint {failing}: File too large",
                        result["failed_write"]), f"rank {rank}: {result['failed_write']}"
