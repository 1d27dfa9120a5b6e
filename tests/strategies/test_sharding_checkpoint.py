"""Checkpoints of sharded runs keep the global format: they resume across sharding strategies and layouts.

On 4 forked gloo ranks: run A trains one epoch of 2 steps with ``FULL_SHARD`` at EP=2 and saves;
run B resumes it with ``NO_SHARD`` at EP=4, trains one more epoch and saves; run C resumes B's
checkpoint with ``FULL_SHARD`` at EP=2 again. In one process (world size 1), run D resumes A's checkpoint.

Oracles: the state each run holds right after loading equals, bit for bit, the state the saving run
held when it saved (weights and AdamW moments, gathered to full tensors through the public state
dict); and the losses of A then B equal an uninterrupted ``NO_SHARD`` run at EP=4 (fp32 tolerance:
the layouts sum in different orders).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback
from strategies.test_sharding_parity import LOCAL_BATCH, dataset, model_config
from strategies.toy import quiet_trainer_kwargs
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_moe.lit import MoELanguageModel
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

WORLD = 4


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


def _capture(trainer, pl_module) -> dict:
    strategy = trainer.strategy
    weights = {k: _full(v) for k, v in strategy.lightning_module_state_dict().items()}
    optimizer_state = strategy.optimizer_state(trainer.optimizers[0])["state"]
    moments = {
        f"{name}/{key}": _full(value)
        for name, entries in optimizer_state.items() for key, value in entries.items() if key != "step"
    }
    return {"weights": weights, "moments": moments, "step": trainer.global_step}


class Capture(Callback):
    """The full state right after loading (``on_train_start``) and at the end of training."""

    def __init__(self) -> None:
        self.start: dict | None = None
        self.end: dict | None = None
        self.losses: list[float] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = _capture(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())

    def on_train_end(self, trainer, pl_module) -> None:
        self.end = _capture(trainer, pl_module)


def _fit(
    devices: int, ep: int, sharding: str, epochs: int, resume: Path | None = None, save: Path | None = None,
    consolidated: bool = False,
):
    torch.manual_seed(0)
    # A constant learning rate: the schedule's length (max_steps) differs between the runs.
    module = MoELanguageModel(model_config(), learning_rate=1e-2, warmup_steps=0, min_lr_ratio=1.0)
    capture = Capture()
    strategy = MoEStrategy(
        expert_parallel_size=ep, sharding_strategy=sharding, save_distributed_checkpoint=not consolidated,
    )
    trainer = L.Trainer(
        **quiet_trainer_kwargs(devices=devices, strategy=strategy, max_epochs=epochs, callbacks=[capture]),
        limit_val_batches=0, limit_train_batches=2,  # epochs of 2 steps, saved when they end
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=LOCAL_BATCH), ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    return {"start": capture.start, "end": capture.end, "losses": capture.losses}


def _four_ranks(rank: int, world_size: int, root: str) -> dict:
    a, b = Path(root) / "a.ckpt", Path(root) / "b.ckpt"
    return {
        "A": _fit(WORLD, 2, "FULL_SHARD", 1, save=a),
        "B": _fit(WORLD, 4, "NO_SHARD", 2, resume=a, save=b),
        "C": _fit(WORLD, 2, "FULL_SHARD", 3, resume=b),
        "U": _fit(WORLD, 4, "NO_SHARD", 2),
        # One consolidated file of full tensors (weights only), loaded into a sharded model.
        "E": _fit(WORLD, 2, "FULL_SHARD", 1, save=Path(root) / "e.pt", consolidated=True),
        "F": _fit(WORLD, 2, "FULL_SHARD", 2, resume=Path(root) / "e.pt"),
    }


def _one_process(rank: int, world_size: int, root: str) -> dict:
    return _fit(1, 1, "NO_SHARD", 2, resume=Path(root) / "a.ckpt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharding_ckpt")
    ranks = run_distributed(_four_ranks, WORLD, str(root), timeout_s=300, tmp_dir=tmp_path_factory.mktemp("pg4"))
    (single,) = run_distributed(_one_process, 1, str(root), timeout_s=120, tmp_dir=tmp_path_factory.mktemp("pg1"))
    return ranks, single


def _assert_identical(loaded: dict, saved: dict, what: str) -> None:
    assert loaded["step"] == saved["step"]
    for part in ("weights", "moments"):
        assert loaded[part].keys() == saved[part].keys(), (what, part)
        for name, value in saved[part].items():
            torch.testing.assert_close(loaded[part][name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{what} {n}: {m}")


@pytest.mark.parametrize(("loaded", "saved"), [("B", "A"), ("C", "B")])
def test_resume_across_sharding_and_expert_parallel_size_is_exact(runs, loaded, saved):
    ranks, _ = runs
    for r in ranks:
        _assert_identical(r[loaded]["start"], r[saved]["end"], f"{saved} -> {loaded}")


def test_consolidated_file_loads_into_a_sharded_model(runs):
    ranks, _ = runs
    for r in ranks:
        loaded, saved = r["F"]["start"]["weights"], r["E"]["end"]["weights"]
        assert loaded.keys() == saved.keys()
        for name, value in saved.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_resume_sharded_checkpoint_in_one_process_is_exact(runs):
    ranks, single = runs
    _assert_identical(single["start"], ranks[0]["A"]["end"], "A -> one process")
    assert single["start"]["moments"], "the optimizer state was loaded"


def test_resumed_losses_equal_the_uninterrupted_run(runs):
    ranks, _ = runs
    for r in ranks:
        resumed = r["A"]["losses"] + r["B"]["losses"]
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(r["U"]["losses"]), rtol=1e-5, atol=1e-6)
        assert len(r["C"]["losses"]) == 2
