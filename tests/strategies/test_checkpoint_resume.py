"""`MoEStrategy` checkpoints: save at EP=2 at an epoch boundary, resume at EP=2, EP=4 and in one process.

Run A (4 ranks, EP=2, dense DP=4) trains 2 epochs of 2 optimizer steps uninterrupted, with a
``ModelCheckpoint`` writing a sharded checkpoint at the end of epoch 0; a callback captures the
full model and AdamW state (expert shards reassembled) right before that save. Runs B (EP=2) and
C (EP=4) on 4 ranks, and D (one process, EP=1, the 4 ranks' global batch as its batch) resume from
that checkpoint with ``trainer.fit(ckpt_path=...)`` and capture the state in ``on_train_start``,
i.e. right after loading and before any step.

Checks: the checkpoint on disk holds the captured state (read with DCP's own consolidation, not the
strategy); every resumed run starts from exactly that state (weights, ``exp_avg``,
``exp_avg_sq``, ``step``) at epoch 1 / step 2; the resumed loss curves agree with each other and
with the uninterrupted run's epoch 1.

Data: Lightning's injected DistributedSampler shuffles (seed 0, ``set_epoch``); its epoch-1
permutation is the same for any number of replicas, and the 4 ranks' m-th batches together are the
m-th block of 8 positions of it, which is exactly the m-th batch of the single process with batch 8
(``strategies.toy.sample_indices``). So every run sees the same global batches.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from strategies.toy import (
    DP,
    LOCAL_BATCH,
    ToyModule,
    full_tensors,
    make_dataset,
    quiet_trainer_kwargs,
    train_loader,
)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

from lightning_moe.checkpoint.sharded import SafeFileSystemReader
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

WORLD = 4
STEPS_PER_EPOCH = 2
NUM_SAMPLES = DP * LOCAL_BATCH * STEPS_PER_EPOCH
CKPT_NAME = "epoch=0.ckpt"
OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq", "step")

# Same layout (EP=2 -> EP=2) repeats the same arithmetic: bitwise. Another EP size or one process
# changes the summation order of the all-to-all / gradient all-reduce: fp32 rounding only.
SAME_LAYOUT_LOSS_TOL = 0.0
RESHARDED_LOSS_RTOL, RESHARDED_LOSS_ATOL = 1e-5, 1e-6


def _full_state(pl_module, trainer) -> dict:
    """Full model parameters and AdamW state, keyed by the LightningModule's parameter names."""
    params = dict(pl_module.named_parameters())
    weights = full_tensors(pl_module, dict(params))
    (optimizer,) = trainer.optimizers
    moments = {}
    for key in ("exp_avg", "exp_avg_sq"):
        values = full_tensors(pl_module, {n: optimizer.state[p][key] for n, p in params.items() if p in optimizer.state})
        for name, value in values.items():
            moments.setdefault(name, {})[key] = value
    for name, p in params.items():
        if p in optimizer.state:
            step = optimizer.state[p]["step"]
            moments[name]["step"] = torch.as_tensor(step).detach().clone()
    return {"weights": weights, "optimizer": moments, "global_step": trainer.global_step,
            "epoch": trainer.current_epoch}


class StateCapture(Callback):
    """Captures the full state at the end of epoch 0 (before ModelCheckpoint, which Lightning runs
    last) and at the start of training (after a checkpoint was restored)."""

    def __init__(self) -> None:
        self.at_epoch0_end: dict | None = None
        self.at_train_start: dict | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.at_train_start = _full_state(pl_module, trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            self.at_epoch0_end = _full_state(pl_module, trainer)


def _fit(ep: int, devices: int, batch_size: int, ckpt_dir: Path | None = None, ckpt_path: Path | None = None):
    model = ToyModule()
    capture = StateCapture()
    callbacks: list[Callback] = [capture]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=devices, strategy=MoEStrategy(expert_parallel_size=ep), max_epochs=2, callbacks=callbacks,
        enable_checkpointing=ckpt_dir is not None,
    ))
    trainer.fit(model, train_loader(make_dataset(NUM_SAMPLES), batch_size), ckpt_path=ckpt_path)
    return {"losses": model.losses, "start": capture.at_train_start, "epoch0_end": capture.at_epoch0_end,
            "global_step": trainer.global_step}


def _save(rank: int, world_size: int, ckpt_dir: str) -> dict:
    return _fit(ep=2, devices=WORLD, batch_size=LOCAL_BATCH, ckpt_dir=Path(ckpt_dir))


def _resume_on_four_ranks(rank: int, world_size: int, ckpt_dir: str) -> dict:
    ckpt = Path(ckpt_dir) / CKPT_NAME
    return {
        "B_ep2": _fit(ep=2, devices=WORLD, batch_size=LOCAL_BATCH, ckpt_path=ckpt),
        "C_ep4": _fit(ep=4, devices=WORLD, batch_size=LOCAL_BATCH, ckpt_path=ckpt),
    }


def _resume_in_one_process(rank: int, world_size: int, ckpt_dir: str) -> dict:
    return _fit(ep=1, devices=1, batch_size=WORLD * LOCAL_BATCH, ckpt_path=Path(ckpt_dir) / CKPT_NAME)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Run A on 4 ranks (EP=2): 2 epochs, checkpoint at the end of epoch 0."""
    root = tmp_path_factory.mktemp("ckpt_resume")
    ckpt_dir = root / "checkpoints"
    ranks = run_distributed(_save, WORLD, str(ckpt_dir), timeout_s=120, tmp_dir=root)
    return {"ranks": [{"A": r} for r in ranks], "ckpt_dir": ckpt_dir, "root": root}


@pytest.fixture(scope="module")
def runs(saved):
    """The saved run plus runs B (EP=2) and C (EP=4) on 4 ranks and D (one process) resumed from it."""
    resumed = run_distributed(_resume_on_four_ranks, WORLD, str(saved["ckpt_dir"]), timeout_s=120, tmp_dir=saved["root"])
    (single,) = run_distributed(_resume_in_one_process, 1, str(saved["ckpt_dir"]), timeout_s=120, tmp_dir=saved["root"])
    ranks = [{**a, **b} for a, b in zip(saved["ranks"], resumed)]
    return {**saved, "ranks": ranks, "single": single}


def _mean_losses(ranks: list[dict], run: str) -> torch.Tensor:
    return torch.tensor([r[run]["losses"] for r in ranks], dtype=torch.float64).mean(0)


def _assert_states_equal(got: dict, want: dict, label: str) -> None:
    assert got["weights"].keys() == want["weights"].keys(), label
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{label} {n}: {m}")
    assert got["optimizer"].keys() == want["optimizer"].keys(), label
    for name, entries in want["optimizer"].items():
        assert set(got["optimizer"][name]) == set(OPTIMIZER_KEYS) == set(entries), (label, name)
        for key, value in entries.items():
            torch.testing.assert_close(got["optimizer"][name][key].float(), value.float(), rtol=0, atol=0,
                                       msg=lambda m, n=name, k=key: f"{label} {n}/{k}: {m}")


def test_checkpoint_written_at_epoch_boundary(saved):
    runs = saved
    ckpt = runs["ckpt_dir"] / CKPT_NAME
    assert ckpt.is_dir() and (ckpt / "meta.pt").is_file(), sorted(p.name for p in runs["ckpt_dir"].iterdir())
    meta = torch.load(ckpt / "meta.pt", weights_only=True)
    assert meta["epoch"] == 0 and meta["global_step"] == STEPS_PER_EPOCH
    assert meta["lightning_moe"]["layout"]["ep"] == 2 and meta["lightning_moe"]["layout"]["world_size"] == WORLD
    for r in runs["ranks"]:
        assert r["A"]["global_step"] == 2 * STEPS_PER_EPOCH
        assert r["A"]["epoch0_end"]["global_step"] == STEPS_PER_EPOCH


def _public(name: str, stored: torch.Tensor) -> torch.Tensor:
    """A captured parameter (or moment) in the checkpoint's layout: the toy's swiglu expert fc1 is
    stored ``[E, 2F, H]`` and checkpointed as ``[E, 2, F, H]`` (docs/architecture.md §6)."""
    return stored.unflatten(1, (2, -1)) if name.endswith("experts.fc1_weight") and stored.dim() == 3 else stored


def test_checkpoint_on_disk_holds_the_saved_state(saved):
    """DCP's own consolidation of the shards (no strategy code) equals the state captured before saving."""
    runs = saved
    consolidated = runs["root"] / "consolidated.pt"
    dcp_to_torch_save(runs["ckpt_dir"] / CKPT_NAME, consolidated)
    on_disk = torch.load(consolidated, weights_only=False)
    saved = runs["ranks"][0]["A"]["epoch0_end"]
    weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in on_disk["state_dict"].items()}
    assert {k: v for k, v in weights.items() if k in saved["weights"]}.keys() == saved["weights"].keys()
    for name, value in saved["weights"].items():
        torch.testing.assert_close(weights[name], _public(name, value), rtol=0, atol=0)
    optimizer = on_disk["optimizer_0"]
    assert optimizer.keys() == saved["optimizer"].keys()
    for name, entries in saved["optimizer"].items():
        for key, value in entries.items():
            torch.testing.assert_close(torch.as_tensor(optimizer[name][key]).float(), _public(name, value).float(),
                                       rtol=0, atol=0)


def test_saved_state_is_the_same_on_every_rank(saved):
    runs = saved
    first = runs["ranks"][0]["A"]["epoch0_end"]
    for r in runs["ranks"][1:]:
        _assert_states_equal(r["A"]["epoch0_end"], first, "rank vs rank 0")


@pytest.mark.parametrize("run", ["B_ep2", "C_ep4", "single_ep1"])
def test_state_right_after_loading_equals_saved(runs, run):
    saved = runs["ranks"][0]["A"]["epoch0_end"]
    loaded = [runs["single"]] if run == "single_ep1" else [r[run] for r in runs["ranks"]]
    for k, result in enumerate(loaded):
        start = result["start"]
        assert start["global_step"] == STEPS_PER_EPOCH and start["epoch"] == 1
        _assert_states_equal(start, saved, f"{run} rank {k}")


def test_resumed_loss_curves(runs):
    ranks = runs["ranks"]
    uninterrupted = _mean_losses(ranks, "A")
    assert len(uninterrupted) == 2 * STEPS_PER_EPOCH
    epoch1 = uninterrupted[STEPS_PER_EPOCH:]
    curves = {
        "B_ep2": _mean_losses(ranks, "B_ep2"),
        "C_ep4": _mean_losses(ranks, "C_ep4"),
        "single_ep1": torch.tensor(runs["single"]["losses"], dtype=torch.float64),
    }
    for name, curve in curves.items():
        assert len(curve) == STEPS_PER_EPOCH, name
    # Same layout: the first resumed loss (and the rest) equal the uninterrupted run's, bitwise.
    torch.testing.assert_close(curves["B_ep2"], epoch1, rtol=SAME_LAYOUT_LOSS_TOL, atol=SAME_LAYOUT_LOSS_TOL)
    for name in ("C_ep4", "single_ep1"):
        torch.testing.assert_close(curves[name], curves["B_ep2"], rtol=RESHARDED_LOSS_RTOL, atol=RESHARDED_LOSS_ATOL,
                                   msg=lambda m, n=name: f"{n} vs B_ep2: {m}")
        torch.testing.assert_close(curves[name][0], epoch1[0], rtol=RESHARDED_LOSS_RTOL, atol=RESHARDED_LOSS_ATOL)
    # The resumed runs did train (the second epoch's losses are not the first epoch's).
    assert not torch.allclose(epoch1, uninterrupted[:STEPS_PER_EPOCH])


# -- the restricted metadata reader the strategy loads with ------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("checkpoint_id", [str, Path], ids=["str", "Path"])
def test_safe_reader_reads_metadata_that_dcp_writes(tmp_path, checkpoint_id):
    """Library bug (fixed): `SafeFileSystemReader` could not read any DCP checkpoint written by torch 2.13.

    ``FileSystemWriter`` stores ``StorageMeta(checkpoint_id=PosixPath(...))`` in ``.metadata``
    (it converts even a ``str`` id to a ``Path``); the allowlist (now ``_ALLOWED_GLOBALS`` of
    ``lightning_moe/checkpoint/security.py``) had no ``pathlib`` entry, so
    ``read_metadata`` raised "Refusing to load pathlib.PosixPath" and every
    ``trainer.fit(ckpt_path=...)`` with `MoEStrategy` failed (all resume tests above).
    """
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=checkpoint_id(tmp_path))
    metadata = SafeFileSystemReader(tmp_path).read_metadata()
    assert "w" in metadata.state_dict_metadata


def test_safe_reader_refuses_arbitrary_globals(tmp_path):
    """The allowlist must stay an allowlist (guards the fix of the test above)."""
    (tmp_path / ".metadata").write_bytes(pickle.dumps(os.system))
    with pytest.raises(pickle.UnpicklingError, match=r"Refusing to load (posix|nt)\.system"):
        SafeFileSystemReader(tmp_path).read_metadata()
