"""A model built on the meta device trains exactly like one built directly.

``MoEStrategy`` parallelizes the meta model (experts cut to their shards), gives its meta tensors
storage and re-draws every weight from its seeds. The shard tags that route expert gradients
to the expert-data-parallel group must survive that, and the run must equal a directly built one.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models import MoETransformerConfig
from lightning_moe.parallel import is_expert_param
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

LOSS_TOL = 1e-6  # identical arithmetic; only the weights' construction path differs


class _MetaBuilt(MoELanguageModel):
    """Builds its transformer on the meta device, as large models must."""

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                super().configure_model()


def _config() -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64,
        first_dense_layers=1, moe=MoEConfig(32, 16, 8, top_k=2, load_balancing=["aux_loss"], aux_loss_coeff=0.01),
    )


def _fit(rank: int, world: int, meta: bool) -> dict:
    torch.manual_seed(0)
    module = (_MetaBuilt if meta else MoELanguageModel)(_config(), warmup_steps=1)
    tokens = torch.randint(0, 64, (16, 9), generator=torch.Generator().manual_seed(3))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=MoEStrategy(tensor_parallel_size=2, expert_parallel_size=2, expert_tensor_parallel_size=1),
        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Record()],
    )
    trainer.fit(module, data)
    experts = [name for name, p in module.named_parameters() if is_expert_param(p)]
    return {"losses": losses, "expert_params": experts, "meta_left": any(p.is_meta for p in module.parameters())}


def test_meta_device_model_trains_like_a_directly_built_one(tmp_path):
    direct = run_distributed(_fit, 2, False, timeout_s=120, tmp_dir=tmp_path)
    meta = run_distributed(_fit, 2, True, timeout_s=120, tmp_dir=tmp_path)
    for rank in range(2):
        assert not meta[rank]["meta_left"]
        assert meta[rank]["expert_params"] == direct[rank]["expert_params"] != []
        assert meta[rank]["losses"] == pytest.approx(direct[rank]["losses"], abs=LOSS_TOL, rel=0)
