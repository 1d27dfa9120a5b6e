"""SIGTERM (what SLURM sends before it kills a job): a checkpoint, a non-zero exit, then a resume.

Rank 0 receives the signal after step 2; `CheckpointOnSigterm` agrees on it with every rank at the
next batch end (without the callback, every rank gets it and Lightning stops them). Oracle: the
step counter and the checkpoint itself: the run exits with 143, `CheckpointOnSigterm` wrote
``last.ckpt`` at the step it stopped, and ``ckpt_path="last"`` resumes there and finishes.
"""

from __future__ import annotations

import os
import signal

import lightning as L
import pytest
import torch.distributed as dist
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from strategies.toy import ToyModule, make_dataset, quiet_trainer_kwargs, train_loader

from lightning_moe.callbacks import CheckpointOnSigterm
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

STEPS = 4


class TermOnRankZero(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if dist.get_rank() == 0 and trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)


def _run(rank: int, world: int, ckpt_dir: str, resume: bool) -> dict:
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=100), CheckpointOnSigterm()]
    if not resume:
        callbacks.append(TermOnRankZero())
    kwargs = quiet_trainer_kwargs(devices=world, strategy=MoEStrategy(expert_parallel_size=2), max_steps=STEPS,
                                  callbacks=callbacks, enable_checkpointing=True)
    trainer = L.Trainer(**kwargs)
    try:
        trainer.fit(ToyModule(), train_loader(make_dataset(64)), ckpt_path="last" if resume else None)
    except SystemExit as stop:
        return {"exit": stop.code, "step": trainer.global_step, "saved": os.path.isdir(f"{ckpt_dir}/last.ckpt")}
    return {"exit": None, "step": trainer.global_step, "saved": os.path.isdir(f"{ckpt_dir}/last.ckpt")}


def test_sigterm_saves_exits_non_zero_and_resumes(tmp_path):
    ckpt_dir = str(tmp_path / "checkpoints")
    stopped = run_distributed(_run, 2, ckpt_dir, False, timeout_s=120, tmp_dir=tmp_path)
    assert [r["exit"] for r in stopped] == [128 + signal.SIGTERM] * 2
    assert all(r["saved"] for r in stopped)
    stopped_at = stopped[0]["step"]
    assert 2 <= stopped_at < STEPS and all(r["step"] == stopped_at for r in stopped)
    resumed = run_distributed(_run, 2, ckpt_dir, True, timeout_s=120, tmp_dir=tmp_path)
    assert [r["exit"] for r in resumed] == [None, None]
    assert [r["step"] for r in resumed] == [STEPS, STEPS]


class TermEveryRank(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)


def _run_without_the_callback(rank: int, world: int) -> object:
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=world, strategy=MoEStrategy(expert_parallel_size=2), max_steps=STEPS, callbacks=[TermEveryRank()],
    ))
    try:
        trainer.fit(ToyModule(), train_loader(make_dataset(64)))
    except SystemExit as stop:
        return stop.code
    return "finished"


def test_sigterm_without_the_callback_still_exits_non_zero(tmp_path):
    """Lightning's own SIGTERM stop exits 0; under MoEStrategy it is 143."""
    codes = run_distributed(_run_without_the_callback, 2, timeout_s=120, tmp_dir=tmp_path)
    assert codes == [128 + signal.SIGTERM] * 2
