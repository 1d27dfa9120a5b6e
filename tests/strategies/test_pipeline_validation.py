"""Validation under `MoEStrategy(pipeline_parallel_size=2)` logs the PP=1 ``val_loss`` and ``val_ppl``.

Oracle: ``Trainer.validate`` of the same module (same seed, same weights) at PP=1 on one process,
itself checked against a plain forward of the transformer: ``val_loss`` is the mean loss per
target token over every batch, ``val_ppl`` its exponential. On 2 forked gloo ranks, PP=2 with
1F1B and ``M=2`` micro-batches per batch must log the same two values (on both ranks), on 2
validation batches whose micro-batches keep very different numbers of targets (one keeps none):
the plain mean of the micro-batch means would be far off. A module without
``pipeline_validation_step`` still gets that plain mean as ``val_loss`` (the documented fallback).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers.dist import run_distributed
from strategies.toy import quiet_trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.lit.module import IGNORE_INDEX
from lightning_moe.models import MoETransformerConfig
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

M, BATCH, SEQ, VOCAB = 2, 4, 8, 64
# Targets kept per micro-batch (of BATCH // M * SEQ = 16), in loader order: 2 validation batches.
KEPT = (2, 16, 0, 5)


def model_config() -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        first_dense_layers=1, max_seq_len=SEQ, moe=MoEConfig(32, 16, 4, top_k=2),
    )


def dataset() -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (len(KEPT) * BATCH // M, SEQ + 1), generator=torch.Generator().manual_seed(7))
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    per_micro = targets.view(len(KEPT), -1)  # micro-batch m: samples m * BATCH // M onwards
    for m, kept in enumerate(KEPT):
        per_micro[m, kept:] = IGNORE_INDEX
    return TensorDataset(inputs, targets)


class WithoutHook(MoELanguageModel):
    """A module of the pipeline protocol without the optional validation hook."""

    pipeline_validation_step = None


def validate(strategy: MoEStrategy, devices: int, cls: type = MoELanguageModel,
             module: MoELanguageModel | None = None) -> tuple[dict, MoELanguageModel]:
    torch.manual_seed(0)
    module = cls(model_config()) if module is None else module
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=devices, strategy=strategy))
    (metrics,) = trainer.validate(module, DataLoader(dataset(), batch_size=BATCH), verbose=False)
    return {k: torch.as_tensor(v) for k, v in metrics.items()}, module


def _reference(rank: int, world_size: int) -> dict:
    metrics, module = validate(MoEStrategy(), 1)
    inputs, targets = dataset().tensors
    with torch.no_grad():
        logits = module.model(inputs).float()
    # Independent of the module's metrics: per target token, and the plain mean of micro-batch means.
    nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    per_micro = nll.view(len(KEPT), -1).sum(1) / torch.tensor(KEPT).clamp(min=1)
    metrics["token_mean"] = nll.sum() / sum(KEPT)
    metrics["micro_mean"] = per_micro.mean()
    return metrics


def _pipeline(rank: int, world_size: int) -> dict:
    def strategy() -> MoEStrategy:
        return MoEStrategy(pipeline_parallel_size=2, pipeline_schedule="1F1B", num_microbatches=M)

    metrics, module = validate(strategy(), 2)
    # The same (now trimmed) module under a new Trainer and strategy of the same layout.
    metrics["again"] = validate(strategy(), 2, module=module)[0]
    try:  # another layout cannot use a model trimmed to this one's stages
        validate(MoEStrategy(), 2, module=module)
        metrics["other layout"] = "no error"
    except ValueError as err:
        metrics["other layout"] = str(err)
    metrics["fallback"] = validate(strategy(), 2, WithoutHook)[0]
    return metrics


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_validation")
    return run_distributed(_reference, 1, timeout_s=60, tmp_dir=tmp)[0], run_distributed(
        _pipeline, 2, timeout_s=60, tmp_dir=tmp)


def test_reference_is_token_weighted(runs):
    want = runs[0]
    torch.testing.assert_close(want["val_loss"], want["token_mean"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(want["val_ppl"], want["token_mean"].exp(), rtol=1e-5, atol=1e-5)
    assert (want["micro_mean"] - want["token_mean"]).abs() > 0.3  # the uneven micro-batches matter


@pytest.mark.parametrize("rank", [0, 1])
def test_pipeline_validation_equals_pp1(runs, rank):
    want, ranks = runs
    got = ranks[rank]
    torch.testing.assert_close(got["val_loss"], want["val_loss"], rtol=1e-5, atol=1e-6)
    assert "val_ppl" in got, f"rank {rank} logged {sorted(got)} under PP=2, no val_ppl"
    torch.testing.assert_close(got["val_ppl"], want["val_ppl"], rtol=1e-5, atol=1e-5)


def test_module_without_hook_gets_the_plain_mean(runs):
    want, ranks = runs
    for rank, result in enumerate(ranks):
        got = result["fallback"]
        assert set(got) == {"val_loss"}, f"rank {rank}: {sorted(got)}"
        torch.testing.assert_close(got["val_loss"], want["micro_mean"], rtol=1e-5, atol=1e-6)


def test_a_trimmed_module_validates_again_under_a_new_strategy(runs):
    for rank, result in enumerate(runs[1]):
        got = result["again"]
        assert set(got) == {"val_loss", "val_ppl"}, f"rank {rank}: {sorted(got)}"
        torch.testing.assert_close(got["val_loss"], result["val_loss"], rtol=0, atol=0)
        # DP=2 x PP=1 on a module parallelized (and trimmed) at PP=2: refused, naming both layouts.
        assert "DP=1, PP=2" in result["other layout"] and "DP=2, PP=1" in result["other layout"], (
            rank, result["other layout"])
