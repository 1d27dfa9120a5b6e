"""`MoEStrategy` saves atomically: a crash mid-save never leaves a checkpoint that mixes two saves.

Every checkpoint is written into a hidden sibling folder and renamed into place once every rank
finished, so ``last.ckpt`` is always either the previous complete checkpoint or the new one.
Crashes are injected on every rank of a real fit (4 gloo ranks, EP=2) while ``ModelCheckpoint``
overwrites ``last.ckpt`` at the end of epoch 1; a second fit resumes with ``ckpt_path="last"`` and
must start from exactly the state captured at the end of epoch 0 (:mod:`strategies.checkpoint_runs`).

Also: no shards of an earlier layout survive in a reused folder, top-k pruning still removes whole
checkpoint folders, and failing writes (a file-size limit stands in for a full disk) and
unwritable checkpoint directories raise errors naming the path and the errno.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import resource
import signal
import traceback
import warnings
from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback
from strategies.checkpoint_runs import STEPS_PER_EPOCH, StateCapture, assert_same_state, fit
from torch.distributed.checkpoint import FileSystemWriter

from lightning_moe.strategies import MoEStrategy
from lightning_moe.strategies.checkpointing import MoECheckpointing

pytestmark = pytest.mark.distributed

WORLD = 4
LAST = "last.ckpt"
EVERY_EPOCH = {"filename": "{epoch}", "save_top_k": 1, "save_last": True, "enable_version_counter": False}
"""ModelCheckpoint: ``epoch=N.ckpt`` (the previous one pruned), then ``last.ckpt`` (Lightning saves
last only after a top-k save), overwriting in place when a resumed run saves the same epoch again."""


class _InjectedCrash(RuntimeError):
    """Stands in for the process being killed at that point of a save."""


_OVERWRITE_LAST = 4
"""The 4th save of an :data:`EVERY_EPOCH` fit overwrites last.ckpt (epoch=0, last, epoch=1, last)."""


def _crash_on_call(owner, name: str, call: int, after: bool):
    """Patch ``owner.name`` so that its ``call``-th call raises, instead of running or right after it."""
    original = getattr(owner, name)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call and not after:
            raise _InjectedCrash(f"injected crash instead of {name}")
        result = original(*args, **kwargs)
        if calls["n"] == call:
            raise _InjectedCrash(f"injected crash after {name}")
        return result

    return mock.patch.object(owner, name, wrapper)


_CRASH_POINTS = {
    # Shards written, DCP's .metadata not (FileSystemWriter.finish runs on rank 0 after every write).
    "before_dcp_metadata": lambda: _crash_on_call(FileSystemWriter, "finish", _OVERWRITE_LAST, after=False),
    # Shards and .metadata written, meta.pt not.
    "before_meta_pt": lambda: _crash_on_call(dcp, "save", _OVERWRITE_LAST, after=True),
}


def _crash_while_overwriting_last_then_resume(rank: int, world_size: int, ckpt_dir: str, crash_point: str) -> dict:
    ckpt_dir = Path(ckpt_dir)
    first = StateCapture()
    error = None
    with _CRASH_POINTS[crash_point]():
        try:
            fit(world_size, ckpt_dir, capture=first, **EVERY_EPOCH)
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            error = "".join(traceback.format_exception(err))
    resumed = fit(world_size, ckpt_dir, ckpt_path="last", **EVERY_EPOCH)
    return {"error": error, "epoch0": first.at_epoch_end[0], "start": resumed.at_train_start,
            "listing": sorted(os.listdir(ckpt_dir))}


@pytest.mark.parametrize("crash_point", sorted(_CRASH_POINTS))
def test_crash_while_overwriting_last_resumes_the_previous_checkpoint(tmp_path, crash_point):
    """Library bug: the shards were written in place, so the crashed folder held the new shards with
    the old metadata and resumed silently from a mix of epochs 0 and 1."""
    ranks = run_distributed(_crash_while_overwriting_last_then_resume, WORLD, str(tmp_path / "ckpts"), crash_point,
                            timeout_s=180, tmp_dir=tmp_path)
    for rank, result in enumerate(ranks):
        assert result["error"] is not None and "injected crash" in result["error"], (rank, result["error"])
        assert result["start"]["epoch"] == 1, rank
        assert_same_state(result["start"], result["epoch0"], f"rank {rank} resumed")
        assert result["epoch0"]["global_step"] == STEPS_PER_EPOCH
    # The resumed run saved last.ckpt again: the leftovers of the crashed save are gone.
    assert ranks[0]["listing"] == ["epoch=1.ckpt", LAST], ranks[0]["listing"]


def _crash_between_the_renames_then_resume(rank: int, world_size: int, ckpt_dir: str) -> dict:
    ckpt_dir = Path(ckpt_dir)
    real_rename = os.rename
    calls = {"n": 0}

    def rename(src, dst, *args, **kwargs):
        if Path(src).name.startswith(f".{LAST}.partial-"):
            calls["n"] += 1
            if calls["n"] == 2:  # the second save: the old last.ckpt is already renamed aside
                raise OSError(errno.EIO, "injected crash between the renames")
        return real_rename(src, dst, *args, **kwargs)

    first = StateCapture()
    error = None
    with mock.patch("os.rename", rename):
        try:
            fit(world_size, ckpt_dir, capture=first, **EVERY_EPOCH)
        except BaseException as err:
            error = "".join(traceback.format_exception(err))
    after_crash = sorted(os.listdir(ckpt_dir))
    # An explicit path to the missing last.ckpt loads the previous checkpoint, with a warning (no
    # ModelCheckpoint here, so nothing is saved and the leftovers stay for the next resume).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explicit = fit(world_size, ckpt_path=ckpt_dir / LAST)
    # ckpt_path="last" finds the previous checkpoint under its interim name.
    resumed = fit(world_size, ckpt_dir, ckpt_path="last", **EVERY_EPOCH)
    return {"error": error, "after_crash": after_crash, "epoch0": first.at_epoch_end[0],
            "explicit": explicit.at_train_start, "warnings": [str(w.message) for w in caught],
            "start": resumed.at_train_start, "listing": sorted(os.listdir(ckpt_dir))}


def test_crash_between_the_renames_resumes_the_previous_checkpoint(tmp_path):
    ranks = run_distributed(_crash_between_the_renames_then_resume, 2, str(tmp_path / "ckpts"), timeout_s=180,
                            tmp_dir=tmp_path)
    first = ranks[0]
    assert "injected crash between the renames" in first["error"], first["error"]
    assert LAST not in first["after_crash"], first["after_crash"]
    aside = [name for name in first["after_crash"] if re.fullmatch(r"last\.replaced-[0-9a-f]+\.ckpt", name)]
    assert len(aside) == 1, first["after_crash"]
    assert any(re.search(rf"{LAST} is missing.*interrupted.*{aside[0]}", w) for w in first["warnings"]), first["warnings"]
    for rank, result in enumerate(ranks):
        for run in ("explicit", "start"):
            assert result[run]["epoch"] == 1, (rank, run)
            assert_same_state(result[run], result["epoch0"], f"rank {rank} {run}")
    assert first["listing"] == ["epoch=1.ckpt", LAST], first["listing"]


EVERY_EPOCH_KEEP_ALL = {"filename": "{epoch}", "save_top_k": -1, "save_last": True}
"""As :data:`EVERY_EPOCH`, every epoch kept, with Lightning's default version counter (``-v1`` on a name clash)."""


def _cut_first_last_save_then_resume(rank: int, world_size: int, ckpt_dir: str) -> dict:
    ckpt_dir = Path(ckpt_dir)
    first = StateCapture()
    # The 2nd save, the first of last.ckpt, is cut before its meta.pt.
    with _crash_on_call(dcp, "save", 2, after=True), pytest.raises(RuntimeError, match="injected crash"):
        fit(world_size, ckpt_dir, capture=first, **EVERY_EPOCH_KEEP_ALL)
    after_crash = sorted(os.listdir(ckpt_dir))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fit(world_size, ckpt_dir, ckpt_path="last", **EVERY_EPOCH_KEEP_ALL)
    return {"after_crash": after_crash, "epoch0": first.at_epoch_end[0], "start": resumed.at_train_start,
            "warnings": [str(w.message) for w in caught], "listing": sorted(os.listdir(ckpt_dir))}


def test_last_falls_back_to_the_newest_complete_checkpoint_when_the_first_last_save_was_cut(tmp_path):
    """Library bug: ``ckpt_path="last"`` found no ``last*.ckpt`` and restarted from step 0, beside
    the complete ``epoch=0.ckpt``, then saved epoch 0 again as ``epoch=0-v1.ckpt``."""
    ranks = run_distributed(_cut_first_last_save_then_resume, 2, str(tmp_path / "ckpts"), timeout_s=180,
                            tmp_dir=tmp_path)
    first = ranks[0]
    partial, complete = first["after_crash"]
    assert partial.startswith(f".{LAST}.partial-") and complete == "epoch=0.ckpt", first["after_crash"]
    assert any(re.search(r'ckpt_path="last".*no complete last checkpoint.*newest complete checkpoint.*epoch=0\.ckpt', w)
               for w in first["warnings"]), first["warnings"]
    for rank, result in enumerate(ranks):
        assert result["start"]["epoch"] == 1, rank
        assert_same_state(result["start"], result["epoch0"], f"rank {rank} resumed")
    assert first["listing"] == ["epoch=0.ckpt", "epoch=1.ckpt", LAST], first["listing"]  # no epoch=0-v1.ckpt


def _save_last_once(rank: int, world_size: int, ckpt_dir: str) -> None:
    fit(world_size, Path(ckpt_dir), max_epochs=1, **EVERY_EPOCH)


def _resume_from_last(rank: int, world_size: int, ckpt_dir: str) -> int:
    return fit(world_size, ckpt_path=Path(ckpt_dir) / LAST).at_train_start["global_step"]


def test_no_stale_shards_of_an_earlier_layout_survive(tmp_path):
    """Library bug: overwriting last.ckpt from 2 ranks kept the 4-rank save's __2_0/__3_0 shards."""
    ckpt_dir = tmp_path / "ckpts"
    run_distributed(_save_last_once, 4, str(ckpt_dir), tmp_dir=tmp_path)
    assert len(list((ckpt_dir / LAST).glob("*.distcp"))) == 4
    run_distributed(_save_last_once, 2, str(ckpt_dir), tmp_dir=tmp_path)
    with open(ckpt_dir / LAST / ".metadata", "rb") as file:
        metadata = pickle.load(file)  # written by this test: trusted
    named = {info.relative_path for info in metadata.storage_data.values()}
    assert named == {"__0_0.distcp", "__1_0.distcp"}
    assert sorted(os.listdir(ckpt_dir / LAST)) == sorted({".metadata", "meta.pt", "meta.pt.json", *named})
    assert sorted(os.listdir(ckpt_dir)) == ["epoch=0.ckpt", LAST]
    assert run_distributed(_resume_from_last, 2, str(ckpt_dir), tmp_dir=tmp_path) == [STEPS_PER_EPOCH] * 2


def _top_k_and_last(rank: int, world_size: int, ckpt_dir: str) -> None:
    fit(world_size, Path(ckpt_dir), max_epochs=3, filename="{epoch}", save_top_k=1, save_last=True)


def test_top_k_pruning_removes_whole_checkpoints(tmp_path):
    """ModelCheckpoint deletes the replaced top-k folder through the strategy; nothing else is left."""
    ckpt_dir = tmp_path / "ckpts"
    run_distributed(_top_k_and_last, 2, str(ckpt_dir), tmp_dir=tmp_path)
    assert sorted(os.listdir(ckpt_dir)) == ["epoch=2.ckpt", LAST]
    for name in ("epoch=2.ckpt", LAST):
        meta = torch.load(ckpt_dir / name / "meta.pt", weights_only=True)
        assert meta["epoch"] == 2 and meta["global_step"] == 3 * STEPS_PER_EPOCH, name


def test_remove_deletes_the_checkpoint_and_its_leftovers(tmp_path):
    """What `MoEStrategy.remove_checkpoint` should call on rank 0: the folder and what interrupted
    saves of it left (a partial save, the previous checkpoint renamed aside), nothing else."""
    for name in (LAST, f".{LAST}.partial-0a1b", "last.replaced-2c3d.ckpt", "epoch=0.ckpt", ".last-v1.ckpt.partial-4e"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.pt").write_bytes(b"x")
    MoECheckpointing(strategy=None).remove(tmp_path / LAST)
    assert sorted(os.listdir(tmp_path)) == [".last-v1.ckpt.partial-4e", "epoch=0.ckpt"]


# -- clear errors on save -----------------------------------------------------------------------

_FILE_SIZE_LIMIT = 16 << 10
"""Bytes: below one rank's shard of the toy model with its AdamW moments (~80 KiB), above the rest."""


class _FileSizeLimitAtEpoch(Callback):
    """From the end of ``epoch`` on (before ModelCheckpoint, which Lightning runs last), writing a
    regular file past :data:`_FILE_SIZE_LIMIT` fails with EFBIG, as a full disk fails with ENOSPC."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
            resource.setrlimit(resource.RLIMIT_FSIZE, (_FILE_SIZE_LIMIT, resource.RLIM_INFINITY))


def _save_fails_past_the_file_size_limit(rank: int, world_size: int, ckpt_dir: str) -> int:
    last, failing = Path(ckpt_dir) / LAST, Path(ckpt_dir) / "epoch=1.ckpt"
    try:
        pattern = rf"\[Errno {errno.EFBIG}\] Could not write the checkpoint {re.escape(str(failing))}: File too large"
        with pytest.raises(OSError, match=pattern):
            fit(world_size, Path(ckpt_dir), ep=1, callbacks=[_FileSizeLimitAtEpoch(1)], **EVERY_EPOCH)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    return torch.load(last / "meta.pt", weights_only=True)["epoch"]


def test_failing_write_names_the_checkpoint_and_the_errno(tmp_path):
    """Library bug: the error was torch's "unexpected pos 704 vs 598", naming no file and no errno."""
    epochs = run_distributed(_save_fails_past_the_file_size_limit, 1, str(tmp_path / "ckpts"), tmp_dir=tmp_path)
    assert epochs == [0]  # last.ckpt is still the complete epoch-0 checkpoint


def _check_writable(rank: int, world_size: int, good: str, bad: str) -> list[str]:
    checkpointing = MoEStrategy().checkpointing
    checkpointing.check_writable(good)
    pattern = rf"\[Errno {errno.ENOTDIR}\] Checkpoint directory {re.escape(bad)} is not writable: Not a directory"
    with pytest.raises(NotADirectoryError, match=pattern):
        checkpointing.check_writable(bad)
    return os.listdir(good)


def test_check_writable_raises_on_every_rank(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    good, bad = tmp_path / "ckpts", tmp_path / "a_file" / "ckpts"
    assert run_distributed(_check_writable, 2, str(good), str(bad), tmp_dir=tmp_path) == [[], []]


def _fit_into_unwritable_dir(rank: int, world_size: int, bad: str) -> str:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from strategies.toy import ToyModule, make_dataset, quiet_trainer_kwargs, train_loader

    module = ToyModule()
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=world_size, strategy=MoEStrategy(expert_parallel_size=2), max_steps=2, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=bad)],
    ))
    try:
        trainer.fit(module, train_loader(make_dataset(16)))
    except NotADirectoryError as err:
        return f"{err} after {len(module.losses)} steps"
    return "trained"


def test_an_unwritable_checkpoint_directory_fails_before_training(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    bad = str(tmp_path / "a_file" / "ckpts")
    for outcome in run_distributed(_fit_into_unwritable_dir, 2, bad, tmp_dir=tmp_path):
        assert f"Checkpoint directory {bad} is not writable" in outcome and outcome.endswith("after 0 steps")
