"""`TextDataModule`'s ``val_loss`` counts every validation sequence once, whatever the layout.

Oracle: the mean cross-entropy over every target of the validation set, computed here from one
forward of the whole set (same seed, same weights). ``Trainer.validate`` must log it (and its
``exp`` as ``val_ppl``) on one
process and on 4 gloo ranks at DP=4, PP=2 (DP=2, 2 micro-batches: a padded micro-batch holds no
target) and CP=2 (DP=2). The 11 validation sequences fill no whole batch of 2 per rank: the ranks'
last batches are padded with rows of ignored targets (the old loader dropped them: 8 of 11 counted
at DP=4, 10 on one process).
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers.dist import run_distributed
from strategies.toy import quiet_trainer_kwargs

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel, TextDataModule
from lightning_moe.models import MoETransformerConfig
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

SEQ, BATCH, VAL_SAMPLES = 8, 2, 11
TOL = 1e-5  # fp32: the same targets summed in another order


def _corpus(root) -> str:
    """Two documents of VAL_SAMPLES samples each (one goes to validation), random letters."""
    g = torch.Generator().manual_seed(11)
    root.mkdir()
    for name in ("a.txt", "b.txt"):
        letters = torch.randint(0, 26, (VAL_SAMPLES * (SEQ + 1) - 1,), generator=g)
        (root / name).write_text("".join(chr(ord("a") + int(i)) for i in letters))
    return str(root)


def _config() -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=320, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        first_dense_layers=1, max_seq_len=SEQ, moe=MoEConfig(32, 16, 4, top_k=2),
    )


def _validate(corpus: str, **layout) -> tuple[float, float]:
    torch.manual_seed(0)
    module = MoELanguageModel(_config())
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=torch.distributed.get_world_size(), strategy=MoEStrategy(**layout)))
    (metrics,) = trainer.validate(module, TextDataModule(corpus, seq_len=SEQ, batch_size=BATCH), verbose=False)
    return float(metrics["val_loss"]), float(metrics["val_ppl"])


def _one(rank: int, world: int, corpus: str) -> dict:
    data = TextDataModule(corpus, seq_len=SEQ, batch_size=BATCH)
    data.setup()
    inputs, targets = (torch.stack(column) for column in zip(*(data.val_set[i] for i in range(len(data.val_set)))))
    torch.manual_seed(0)
    module = MoELanguageModel(_config())
    module.configure_model()
    with torch.no_grad():
        logits = module.model(inputs).float()
    every_target = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return {"samples": len(data.val_set), "oracle": every_target.item(), "one process": _validate(corpus)}


def _four(rank: int, world: int, corpus: str) -> dict:
    return {
        "DP=4": _validate(corpus),
        "PP=2": _validate(corpus, pipeline_parallel_size=2, num_microbatches=2),
        "CP=2": _validate(corpus, context_parallel_size=2),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("val_layouts")
    corpus = _corpus(root / "corpus")
    (one,) = run_distributed(_one, 1, corpus, timeout_s=60, tmp_dir=root)
    return one, run_distributed(_four, 4, corpus, timeout_s=180, tmp_dir=root)


def test_one_process_counts_every_validation_target(runs):
    one, _ = runs
    assert one["samples"] == VAL_SAMPLES
    assert one["one process"] == pytest.approx((one["oracle"], math.exp(one["oracle"])), rel=TOL, abs=TOL)


@pytest.mark.parametrize("layout", ["DP=4", "PP=2", "CP=2"])
def test_val_loss_does_not_depend_on_the_layout(runs, layout):
    one, four = runs
    for rank, result in enumerate(four):
        want = (one["oracle"], math.exp(one["oracle"]))  # (val_loss, val_ppl)
        assert result[layout] == pytest.approx(want, rel=TOL, abs=TOL), (layout, rank)
