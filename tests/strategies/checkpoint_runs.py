"""Short `MoEStrategy` fits that save or resume checkpoints, and ways to damage or craft one.

Imported as ``from strategies.checkpoint_runs import ...`` by ``test_checkpoint_safety.py``,
``test_checkpoint_integrity.py`` and ``parallel/test_checkpoint_security.py``. :func:`fit` runs
inside a forked rank of ``helpers.dist.run_distributed`` (the process group exists; `MoEStrategy`
launches nothing); :func:`flip_tensor_byte` and :func:`redeclare_as_bytes_item` edit files on disk.

The oracle of every resume is :class:`StateCapture`: the full model weights and AdamW moments
(expert shards reassembled by ``strategies.toy.full_tensors``, not by the strategy) at the end of
each epoch, right before ``ModelCheckpoint`` saves (Lightning runs checkpoint callbacks last), and
at ``on_train_start``, right after a checkpoint was loaded.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from strategies.toy import (
    LOCAL_BATCH,
    ToyModule,
    full_tensors,
    make_dataset,
    quiet_trainer_kwargs,
    train_loader,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from lightning_moe.strategies import MoEStrategy

__all__ = [
    "STEPS_PER_EPOCH",
    "MakeDir",
    "StateCapture",
    "assert_same_state",
    "fit",
    "flip_tensor_byte",
    "redeclare_as_bytes_item",
]

STEPS_PER_EPOCH = 2


def _full_state(pl_module, trainer) -> dict:
    params = dict(pl_module.named_parameters())
    (optimizer,) = trainer.optimizers
    moments = {
        key: full_tensors(pl_module, {n: optimizer.state[p][key] for n, p in params.items() if p in optimizer.state})
        for key in ("exp_avg", "exp_avg_sq")
    }
    return {"weights": full_tensors(pl_module, dict(params)), "moments": moments,
            "global_step": trainer.global_step, "epoch": trainer.current_epoch}


class StateCapture(Callback):
    """Full state at the end of every epoch (``at_epoch_end[epoch]``) and at the start of training."""

    def __init__(self) -> None:
        self.at_epoch_end: dict[int, dict] = {}
        self.at_train_start: dict | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.at_train_start = _full_state(pl_module, trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.at_epoch_end[trainer.current_epoch] = _full_state(pl_module, trainer)


def fit(
    devices: int,
    ckpt_dir: Path | None = None,
    ckpt_path: Path | str | None = None,
    max_epochs: int = 2,
    ep: int = 2,
    strategy: MoEStrategy | None = None,
    callbacks: list[Callback] | None = None,
    capture: StateCapture | None = None,
    **checkpoint_kwargs,
) -> StateCapture:
    """Fit the toy module for ``max_epochs`` of :data:`STEPS_PER_EPOCH` steps; return its capture.

    With ``ckpt_dir`` a ``ModelCheckpoint(dirpath=ckpt_dir, **checkpoint_kwargs)`` saves every epoch.
    Pass ``capture`` to keep what it captured when the fit raises.
    """
    capture = capture if capture is not None else StateCapture()
    all_callbacks: list[Callback] = [capture, *(callbacks or [])]
    if ckpt_dir is not None:
        all_callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, **checkpoint_kwargs))
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=devices, strategy=strategy or MoEStrategy(expert_parallel_size=ep), max_epochs=max_epochs,
        callbacks=all_callbacks, enable_checkpointing=ckpt_dir is not None,
    ))
    dataset = make_dataset(devices * LOCAL_BATCH * STEPS_PER_EPOCH)  # ep = devices or a divisor: dense DP = devices
    trainer.fit(ToyModule(), train_loader(dataset, LOCAL_BATCH), ckpt_path=ckpt_path)
    return capture


def assert_same_state(got: dict, want: dict, label: str) -> None:
    """Bitwise equal weights and moments at the same global step (a resumed run starts the next epoch)."""
    assert got["global_step"] == want["global_step"], (label, got["global_step"], want["global_step"])
    assert got["weights"].keys() == want["weights"].keys(), label
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{label} {n}: {m}")
    for key, values in want["moments"].items():
        assert got["moments"][key].keys() == values.keys(), (label, key)
        for name, value in values.items():
            torch.testing.assert_close(got["moments"][key][name], value, rtol=0, atol=0,
                                       msg=lambda m, n=name, k=key: f"{label} {n}/{k}: {m}")


def flip_tensor_byte(shard: Path, tensor: torch.Tensor) -> None:
    """Flip one byte in the middle of ``tensor``'s raw data inside ``shard`` (found by its bytes)."""
    data = bytearray(shard.read_bytes())
    raw = tensor.detach().contiguous().numpy().tobytes()
    start = data.find(raw)
    assert start >= 0 and data.find(raw, start + 1) < 0, f"{shard.name}: the tensor's bytes are not there exactly once"
    data[start + len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


class MakeDir:
    """Pickles as a call of ``os.makedirs(marker)``: the harmless stand-in for an attacker's code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def redeclare_as_bytes_item(ckpt: Path, key: str, payload: object) -> None:
    """Turn the tensor ``key`` of the DCP checkpoint ``ckpt`` into a pickled (bytes) item holding
    ``payload``: ``torch.save(payload)`` appended to the key's shard, ``.metadata`` pointing there."""
    with open(ckpt / ".metadata", "rb") as file:
        metadata = pickle.load(file)  # written by the calling test: trusted
    (index,) = [i for i in metadata.storage_data if i.fqn == key]
    shard = ckpt / metadata.storage_data[index].relative_path
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    offset = shard.stat().st_size
    with open(shard, "ab") as file:
        file.write(buffer.getvalue())
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    del metadata.storage_data[index]
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(shard.name, offset, len(buffer.getvalue()))
    with open(ckpt / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
