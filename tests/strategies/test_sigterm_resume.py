"""A SIGTERM in the middle of an epoch, then ``ckpt_path``: the uninterrupted run, bit for bit.

`CheckpointOnSigterm` saves at the batch end where every rank agreed on the signal; the resumed
fit must train on exactly the batches the uninterrupted fit trains on after that step (none
twice, none skipped), so its per-step losses and final parameters are identical. Oracle: the
uninterrupted fit of the same layout, seed and `TextDataModule`. The stop falls in the second
epoch (the sampler's order depends on the epoch), or on the first epoch's last batch, and the run
ends in the third.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback
from strategies.toy import quiet_trainer_kwargs
from torch.distributed.tensor import DTensor

from lightning_moe import MoEConfig
from lightning_moe.callbacks import CheckpointOnSigterm
from lightning_moe.lit import MoELanguageModel, TextDataModule
from lightning_moe.models import MoETransformerConfig
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

SEQ = 8
STEPS_PER_EPOCH = 3  # 12 of the corpus's 13 samples per epoch: 2 replicas x batch 2, or 1 x batch 4
MAX_STEPS = 7  # the run ends in epoch 2
# On 2 ranks: (strategy arguments, batch size per replica, steps to stop at). Step 4: in epoch 1,
# after its first batch; step 3: at epoch 0's last batch.
LAYOUTS = {
    "NO_SHARD": ({}, 2, (4, 3)),
    "FULL_SHARD": ({"sharding_strategy": "FULL_SHARD"}, 2, (4,)),
    "PP=2": ({"pipeline_parallel_size": 2, "num_microbatches": 2}, 4, (4,)),
    "CP=2": ({"context_parallel_size": 2}, 4, (4,)),
}


def _corpus(root: Path) -> Path:
    """One document of random letters: 13 samples of SEQ + 1 tokens (its EOS included)."""
    g = torch.Generator().manual_seed(3)
    text = "".join(chr(ord("a") + int(i)) for i in torch.randint(0, 26, (13 * (SEQ + 1) - 1,), generator=g))
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.txt").write_text(text)
    return root


def _config() -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=320, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        first_dense_layers=1, max_seq_len=SEQ, moe=MoEConfig(32, 16, 4, top_k=2),
    )


class Record(Callback):
    """Each step's loss (this rank's), by global step."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step] = outputs["loss"].item()


class TermAt(Callback):
    """Sends this process SIGTERM at the end of global step ``step`` (listed before `CheckpointOnSigterm`)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(corpus: str, ckpt_dir: str, layout: tuple, stop: int | None = None, resume: bool = False) -> dict:
    torch.manual_seed(0)
    record = Record()
    callbacks = [record] + ([TermAt(stop)] if stop is not None else []) + [CheckpointOnSigterm(dirpath=ckpt_dir)]
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=torch.distributed.get_world_size(), strategy=MoEStrategy(**layout[0]), max_steps=MAX_STEPS,
        callbacks=callbacks, limit_val_batches=0,
    ))
    module = MoELanguageModel(_config(), learning_rate=1e-2, warmup_steps=0, min_lr_ratio=1.0)
    data = TextDataModule(corpus, seq_len=SEQ, batch_size=layout[1], val_fraction=0.0)
    try:
        trainer.fit(module, data, ckpt_path=f"{ckpt_dir}/last.ckpt" if resume else None)
    except SystemExit as stop_exit:
        assert stop_exit.code == 128 + signal.SIGTERM
    params = {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in module.state_dict().items()}
    return {"losses": record.losses, "params": params, "step": trainer.global_step,
            "batches": len(trainer.train_dataloader)}


def _stop_and_resume(rank: int, world: int, corpus: str, root: str, layouts: dict) -> dict:
    results = {}
    for name, layout in layouts.items():
        results[name] = {"uninterrupted": _fit(corpus, f"{root}/{name}", layout)}
        for stop in layout[2]:
            ckpt_dir = f"{root}/{name}-{stop}"
            results[name][stop] = {"stopped": _fit(corpus, ckpt_dir, layout, stop=stop),
                                   "resumed": _fit(corpus, ckpt_dir, layout, resume=True)}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sigterm_resume")
    corpus = str(_corpus(root / "corpus"))
    two = run_distributed(_stop_and_resume, 2, corpus, str(root), LAYOUTS, timeout_s=300, tmp_dir=root)
    return {name: [r[name] for r in two] for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sigterm_resume_equals_the_uninterrupted_run(runs, layout):
    for rank, run in enumerate(runs[layout]):
        want = run["uninterrupted"]
        assert want["batches"] == STEPS_PER_EPOCH, (layout, rank, want["batches"])
        assert sorted(want["losses"]) == list(range(1, MAX_STEPS + 1))
        for stop in LAYOUTS[layout][2]:
            stopped, resumed = run[stop]["stopped"], run[stop]["resumed"]
            label = f"{layout} stopped at step {stop}, rank {rank}"
            assert (stopped["step"], resumed["step"]) == (stop, MAX_STEPS), label
            got = {**stopped["losses"], **resumed["losses"]}
            assert sorted(got) == sorted(want["losses"]), (label, sorted(got))
            differ = {step: (got[step], loss) for step, loss in want["losses"].items() if got[step] != loss}
            assert not differ, f"{label}: steps whose loss differs after the resume (got, want): {differ}"
            for name, value in want["params"].items():
                torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=0,
                                           msg=lambda m, n=name, where=label: f"{where} {n}: {m}")
