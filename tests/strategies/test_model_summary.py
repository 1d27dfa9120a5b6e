"""The model summary under `MoEStrategy` counts the whole model, not one rank's shards.

Oracle: the same LightningModule built for one device, counted with ``p.numel()``; its layers are
its children that are not torchmetrics ``Metric`` objects. Under pipeline parallelism (PP=2) every
rank reports the whole model and says which stage it holds. The table printed at fit start has no
FLOPs column and no ``Total Flops`` line (nothing measured FLOPs).
"""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import ModelSummary
from parallel.test_batch_agreement import RankSeededTokens
from strategies.toy import ToyModule, make_dataset, quiet_trainer_kwargs, train_loader
from torchmetrics import Metric

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models import MoETransformerConfig
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

LM_CONFIG = MoETransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                                 ffn_hidden_size=64, first_dense_layers=1, moe=MoEConfig(32, 16, 8, top_k=2))


def _counts(module: L.LightningModule) -> dict:
    per_layer = {name: sum(p.numel() for p in child.parameters()) for name, child in module.named_children()
                 if not isinstance(child, Metric)}
    return {"total": sum(p.numel() for p in module.parameters()), "layers": per_layer}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.text = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.text += record.getMessage()


def _summarised(rank: int, world: int, which: str) -> dict:
    summary = ModelSummary(max_depth=1)
    if which == "toy":
        module, loader = ToyModule(), train_loader(make_dataset(16))
        strategy = MoEStrategy(expert_parallel_size=2)
    else:
        module = MoELanguageModel(LM_CONFIG)
        loader = torch.utils.data.DataLoader(RankSeededTokens(False), batch_size=2)
        strategy = MoEStrategy(pipeline_parallel_size=2, num_microbatches=2) if which == "reference-pp2" else MoEStrategy(
            tensor_parallel_size=2, expert_parallel_size=2, expert_tensor_parallel_size=1)
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=world, strategy=strategy, max_steps=1, callbacks=[summary]))
    printed = _Lines()
    logger = logging.getLogger("lightning.pytorch.callbacks.model_summary")
    logger.addHandler(printed)
    try:
        trainer.fit(module, loader)
    finally:
        logger.removeHandler(printed)
    result = summary._summary(trainer, module)
    return {"total": result.total_parameters, "trainable": result.trainable_parameters,
            "layers": dict(zip(result.layer_names, result.param_nums)), "printed": printed.text, "note": result.note}


@pytest.mark.parametrize("which", ["toy", "reference-tp2-ep2", "reference-pp2"])
def test_summary_reports_global_counts(tmp_path, which):
    if which == "toy":
        want = _counts(ToyModule())
    else:
        module = MoELanguageModel(LM_CONFIG)
        module.configure_model()
        want = _counts(module)
    ranks = run_distributed(_summarised, 2, which, timeout_s=120, tmp_dir=tmp_path)
    for rank, r in enumerate(ranks):
        assert r["total"] == r["trainable"] == want["total"]
        assert r["layers"] == want["layers"]  # the metrics are no layers
        if which == "reference-pp2":
            assert f"this rank holds stage {rank} of 2" in r["note"]
            assert "every count is the whole model's" in r["note"]
        else:
            assert r["note"] is None
    printed = ranks[0]["printed"]
    assert f"{want['total'] / 1000:.1f} K" in printed and "Total params" in printed
    assert "FLOPs" not in printed and "Total Flops" not in printed and "TokenMeanLoss" not in printed
    assert ("this rank holds stage 0 of 2" in printed) == (which == "reference-pp2")
    assert ranks[1]["printed"] == ""  # printed on rank zero only
