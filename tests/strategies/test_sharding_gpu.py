"""Sharded data parallelism on one GPU over NCCL with bf16-mixed (``benchmarks/gpu_check.sh`` runs it).

CPU proxies of the same logic: ``test_sharding_options.py`` (bf16-mixed policy, meta init) and
``test_sharding_parity.py`` (parity and bytes on gloo). Here: FSDP2's real NCCL path (a world of
one still runs the collectives' device code), bf16 gathers and fp32 master weights on CUDA, and
the same losses as ``NO_SHARD`` within bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch
from strategies.test_sharding_parity import LOCAL_BATCH, dataset, model_config
from strategies.toy import quiet_trainer_kwargs
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

pytestmark = pytest.mark.gpu


def _fit(sharding: str, tmp_path) -> tuple[list[float], object]:
    import lightning as L

    from lightning_moe.lit import MoELanguageModel
    from lightning_moe.strategies import MoEStrategy

    torch.manual_seed(0)
    module = MoELanguageModel(model_config(), learning_rate=1e-2, warmup_steps=0)
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

    trainer = L.Trainer(
        **quiet_trainer_kwargs(accelerator="gpu", devices=1, max_steps=3, precision="bf16-mixed",
                               default_root_dir=tmp_path, callbacks=[Record()]),
        strategy=MoEStrategy(process_group_backend="nccl", sharding_strategy=sharding), limit_val_batches=0,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=LOCAL_BATCH))
    return losses, module


def test_full_shard_on_one_gpu_over_nccl_with_bf16_mixed(tmp_path):
    sharded_losses, sharded = _fit("FULL_SHARD", tmp_path / "full")
    replicated_losses, _ = _fit("NO_SHARD", tmp_path / "none")
    assert all(isinstance(p, DTensor) and p.device.type == "cuda" and p.dtype == torch.float32
               for p in sharded.parameters())
    assert all(torch.isfinite(torch.tensor(sharded_losses)))
    torch.testing.assert_close(torch.tensor(sharded_losses), torch.tensor(replicated_losses), rtol=2e-2, atol=2e-2)
