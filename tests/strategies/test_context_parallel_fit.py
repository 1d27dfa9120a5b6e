"""`Trainer.fit` with context parallelism equals the CP=1 run on the same batches, and its checkpoints resume at CP=1.

The strategy cuts every batch to each CP rank's chunks, the model attends over the whole sequence
through the CP exchange, and the loss is the token mean over whole sequences (some targets are
ignored, so the chunks hold different counts). Oracles: CP=2 on 2 ranks (DP=1) and CP=2 x TP=2 on 4
ranks against one process; CP=2 x EP=2 on 4 ranks (DP=2) against EP=2 on 2 ranks; both exchanges;
the sequence-level aux loss on. Losses at every step and all parameters after 3 AdamW steps
(fp32 tolerance). A CP=2 checkpoint resumes in one process with identical weights.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback
from strategies.toy import quiet_trainer_kwargs
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models import MoETransformerConfig
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

SEQ = 16
STEPS = 3
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4  # AdamW turns fp32 noise of near-zero gradients into larger moves


def _config() -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        first_dense_layers=1, qk_norm=True, max_seq_len=SEQ,
        moe=MoEConfig(32, 16, 8, top_k=2, load_balancing=["seq_aux_loss"], aux_loss_coeff=1e-2),
    )


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (16, SEQ + 1), generator=g)
    targets = tokens[:, 1:].clone()
    targets[torch.rand(targets.shape, generator=g) < 0.3] = -100
    return TensorDataset(tokens[:, :-1], targets)


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        torch.distributed.all_reduce(loss)  # the mean over ranks is the step's loss (see cp_token_mean)
        self.losses.append(loss.item() / trainer.world_size)


def _fit(devices: int, save: Path | None = None, resume: Path | None = None, **sizes) -> dict:
    torch.manual_seed(0)
    module = MoELanguageModel(_config(), learning_rate=1e-2, warmup_steps=0, min_lr_ratio=1.0)
    record = Losses()
    trainer = L.Trainer(
        **quiet_trainer_kwargs(devices=devices, strategy=MoEStrategy(**sizes), max_steps=STEPS, callbacks=[record]),
        limit_val_batches=0,
    )
    trainer.fit(module, DataLoader(_dataset(), batch_size=2), ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    params = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in module.state_dict().items()}
    return {"losses": record.losses, "params": params}


def _two(rank: int, world: int, root: str) -> dict:
    return {
        "cp2-p2p": _fit(2, save=Path(root) / "cp2.ckpt", context_parallel_size=2),
        "cp2-all_gather": _fit(2, context_parallel_size=2, cp_comm_type="all_gather"),
        "ep2": _fit(2, expert_parallel_size=2),
    }


def _one(rank: int, world: int, root: str) -> dict:
    # The resumed run stops at once (max_steps reached): what it holds is what it loaded.
    return {"single": _fit(1), "resumed": _fit(1, resume=Path(root) / "cp2.ckpt")}


def _four(rank: int, world: int) -> dict:
    return {
        "cp2-ep2-p2p": _fit(4, context_parallel_size=2, expert_parallel_size=2),
        "cp2-ep2-all_gather": _fit(4, context_parallel_size=2, expert_parallel_size=2, cp_comm_type="all_gather"),
        "cp2-tp2": _fit(4, context_parallel_size=2, tensor_parallel_size=2, expert_tensor_parallel_size=1),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_fit")
    two = run_distributed(_two, 2, str(root), timeout_s=240, tmp_dir=tmp_path_factory.mktemp("pg2"))
    (one,) = run_distributed(_one, 1, str(root), timeout_s=120, tmp_dir=tmp_path_factory.mktemp("pg1"))
    four = run_distributed(_four, 4, timeout_s=300, tmp_dir=tmp_path_factory.mktemp("pg4"))
    return {**{k: [r[k] for r in two] for k in two[0]}, **{k: [one[k]] for k in one},
            **{k: [r[k] for r in four] for k in four[0]}}


def _assert_same(runs: list[dict], oracle: dict) -> None:
    for r in runs:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(oracle["losses"]), rtol=LOSS_TOL, atol=LOSS_TOL)
        for name, value in oracle["params"].items():
            torch.testing.assert_close(r["params"][name], value, rtol=PARAM_TOL, atol=PARAM_TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("case", "oracle"), [
    ("cp2-p2p", "single"), ("cp2-all_gather", "single"), ("cp2-tp2", "single"),
    ("cp2-ep2-p2p", "ep2"), ("cp2-ep2-all_gather", "ep2"),
])
def test_context_parallel_fit_equals_the_cp1_run(runs, case, oracle):
    assert len(runs[oracle][0]["losses"]) == STEPS
    _assert_same(runs[case], runs[oracle][0])


def test_cp2_checkpoint_resumes_in_one_process_with_identical_weights(runs):
    resumed, saved = runs["resumed"][0]["params"], runs["cp2-p2p"][0]["params"]
    assert resumed.keys() == saved.keys()
    for name, value in saved.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
