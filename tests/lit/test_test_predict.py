"""``Trainer.test`` and ``Trainer.predict`` of `MoELanguageModel` with `TextDataModule`.

Oracles: the model applied by hand to every batch of the data module's held-out (validation)
loader: ``F.cross_entropy`` over all their targets for ``test_loss`` (``exp`` of it for
``test_ppl``), ``log_softmax`` of the logits for each predicted batch. At EP=2 on 2 gloo ranks
(each its half of the batches), ``test_loss`` is the single-process loss over all of them.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers.dist import run_distributed
from torch.utils.data import DataLoader

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel, TextDataModule
from lightning_moe.models import MoETransformerConfig
from lightning_moe.strategies import MoEStrategy

SEQ = 16


def _module() -> MoELanguageModel:
    torch.manual_seed(0)
    config = MoETransformerConfig(
        vocab_size=320, hidden_size=32, num_layers=1, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        max_seq_len=SEQ, moe=MoEConfig(32, 16, 4, top_k=2),
    )
    module = MoELanguageModel(config)
    module.configure_model()
    return module.eval()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i in range(6):
        (root / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (1 + i % 2))
    return root


def _data(corpus, val_fraction: float = 0.4) -> TextDataModule:
    return TextDataModule(str(corpus), seq_len=SEQ, batch_size=2, val_fraction=val_fraction)


def _trainer() -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)


def _held_out_batches(data: TextDataModule) -> list:
    data.setup("test")
    return list(data.val_dataloader())


def test_test_reports_the_validation_metrics_of_the_held_out_documents(corpus):
    module, data = _module(), _data(corpus)
    batches = _held_out_batches(data)
    assert len(batches) >= 2
    with torch.no_grad():
        logits = torch.cat([module(inputs) for inputs, _ in batches])
    targets = torch.cat([t for _, t in batches])
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    (metrics,) = _trainer().test(module, datamodule=data, verbose=False)
    assert set(metrics) == {"test_loss", "test_ppl"}
    torch.testing.assert_close(torch.tensor(metrics["test_loss"]), expected)
    torch.testing.assert_close(torch.tensor(metrics["test_ppl"]), expected.exp(), rtol=1e-4, atol=0)


def test_predict_returns_next_token_log_probabilities_per_position(corpus):
    module, data = _module(), _data(corpus)
    data.setup("predict")
    batches = list(data.predict_dataloader())  # every held-out sample, the last batch maybe smaller
    assert sum(len(inputs) for inputs, _ in batches) == len(data.val_set)
    predictions = _trainer().predict(module, datamodule=data)
    assert len(predictions) == len(batches)
    for out, (inputs, _) in zip(predictions, batches):
        assert out.shape == (*inputs.shape, 320) and out.dtype == torch.float32
        with torch.no_grad():
            torch.testing.assert_close(out, torch.log_softmax(module(inputs).float(), dim=-1))
        torch.testing.assert_close(out.exp().sum(-1), torch.ones(inputs.shape))
    # A plain tensor of inputs is a batch too.
    inputs = batches[0][0]
    torch.testing.assert_close(module.predict_step(inputs, 0), predictions[0])


def test_test_without_held_out_documents_says_to_set_val_fraction(corpus):
    data = _data(corpus, val_fraction=0.0)
    data.setup("test")
    with pytest.raises(ValueError, match=r"test data are the held-out \(validation\) documents.*val_fraction > 0"):
        data.test_dataloader()


def _test_ep2(rank: int, world: int, batches: list) -> float:
    module = _module()  # the same seeds, so the same weights as the single-process oracle
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=MoEStrategy(expert_parallel_size=2), logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    (metrics,) = trainer.test(module, dataloaders=DataLoader(batches, batch_size=None), verbose=False)
    return metrics["test_loss"]


@pytest.mark.distributed
def test_test_loss_at_ep2_equals_the_single_process_loss(tmp_path):
    gen = torch.Generator().manual_seed(5)
    batches = [tuple(torch.randint(0, 320, (2, 2, SEQ), generator=gen)) for _ in range(4)]  # 2 per rank
    module = _module()
    with torch.no_grad():
        logits = torch.cat([module(inputs) for inputs, _ in batches])
    expected = F.cross_entropy(logits.flatten(0, 1), torch.cat([t for _, t in batches]).flatten())
    losses = run_distributed(_test_ep2, 2, batches, timeout_s=120, tmp_dir=tmp_path)
    for loss in losses:
        torch.testing.assert_close(torch.tensor(loss), expected)
