"""LoRA under pipeline parallelism: `MoELanguageModel(lora=...)` at PP=2 equals one process.

Oracle: one process (``MoEStrategy()`` at world size 1) with ``accumulate_grad_batches=M`` on the
same micro-batches, as ``tests/strategies/test_pipeline_parity.py`` does for the plain model. On 2
forked gloo ranks, PP=2 with ``num_microbatches=M``: each step's loss (logged from the last stage on
both ranks) and every adapter after the steps (each rank holds its stage's, under their global
names) must match; the frozen base must be unchanged on both sides. AdamW with ``eps=1e-2``
(``tests/lora/test_lora_layouts.py`` says why).
"""

from __future__ import annotations

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
from lightning_moe.lora import LoRAConfig, is_adapter_key
from lightning_moe.models import MoETransformerConfig
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

STEPS, M, BATCH, SEQ, VOCAB = 2, 4, 8, 8, 64
LORA = LoRAConfig(rank=4, alpha=8.0)
TOL = 1e-5


def _config() -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=4, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=32,
        max_seq_len=SEQ, moe=MoEConfig(32, 16, 4, top_k=2, shared_expert_ffn_hidden_size=16),
    )


class _Losses(Callback):
    def __init__(self, scale: float) -> None:
        self.scale, self.losses = scale, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item() * self.scale)  # Lightning divides by the accumulation


class _Module(MoELanguageModel):
    def configure_optimizers(self):
        config = super().configure_optimizers()
        for group in config["optimizer"].param_groups:
            group["eps"] = 1e-2
        return config


def _dataset() -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _fit(strategy: MoEStrategy, devices: int, batch_size: int, accumulate: int) -> dict:
    torch.manual_seed(0)
    module = _Module(_config(), learning_rate=1e-2, warmup_steps=0, lora=LORA)
    losses = _Losses(accumulate)
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=devices, strategy=strategy, max_steps=STEPS, callbacks=[losses],
                                               accumulate_grad_batches=accumulate))
    trainer.fit(module, DataLoader(_dataset(), batch_size=batch_size))
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in module.state_dict().items()}
    return {"losses": torch.tensor(losses.losses).reshape(STEPS, -1).mean(1), "state": state,
            "trainable": sorted(n for n, p in module.named_parameters() if p.requires_grad)}


def _pipeline(rank: int, world: int) -> dict:
    return _fit(MoEStrategy(pipeline_parallel_size=2, num_microbatches=M), 2, BATCH, 1)


def _one_process(rank: int, world: int) -> dict:
    return _fit(MoEStrategy(), 1, BATCH // M, M)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_pipeline")
    return run_distributed(_one_process, 1, timeout_s=120, tmp_dir=tmp)[0], run_distributed(
        _pipeline, 2, timeout_s=300, tmp_dir=tmp)


def test_lora_under_pipeline_parallelism_equals_one_process(runs):
    want, ranks = runs
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got["losses"], want["losses"], rtol=TOL, atol=TOL, msg=lambda m, k=rank: f"rank {k}: {m}")
        assert got["trainable"] and all(is_adapter_key(n) for n in got["trainable"])
    merged = {k: v for r in ranks for k, v in r["state"].items()}
    assert merged.keys() == want["state"].keys(), "the two stages together hold every tensor of the model"
    moved = 0
    for name, value in want["state"].items():
        tol = TOL if is_adapter_key(name) else 0.0  # the frozen base stays bit for bit
        torch.testing.assert_close(merged[name], value, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")
        moved += is_adapter_key(name) and name.endswith("lora_B") and bool(value.abs().max() > 0)
    assert moved, "the adapters trained (B left zero)"
