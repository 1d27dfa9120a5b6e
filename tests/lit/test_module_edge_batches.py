"""`MoELanguageModel` on edge batches: all targets ignored, and empty batches.

Oracles: the model's logits and ``F.cross_entropy`` over the targets kept; ``exp`` of the
token-weighted validation loss for the perplexity; 0 with finite gradients on every parameter
for a micro-batch with no target; a ``ValueError`` with the shapes and likely cause for an empty
batch. Trainer runs are one CPU process, a step or two.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.lit.module import IGNORE_INDEX
from lightning_moe.models import MoETransformerConfig

VOCAB, HIDDEN, SEQ = 64, 32, 8


def _module() -> MoELanguageModel:
    torch.manual_seed(0)
    config = MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=1, num_attention_heads=4, num_kv_heads=2,
        ffn_hidden_size=64, max_seq_len=16,
        moe=MoEConfig(HIDDEN, 16, 4, top_k=2, load_balancing=["aux_loss"], aux_loss_coeff=1e-2),
    )
    module = MoELanguageModel(config, warmup_steps=1)
    module.configure_model()
    for layer in module.modules():
        if hasattr(layer, "aux_loss_scale"):
            layer.aux_loss_scale = 1.0
    return module


def _batch(seed: int, ignored: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    if ignored:
        targets = torch.full_like(targets, IGNORE_INDEX)
    return inputs, targets


def _loader(batches: list) -> DataLoader:
    """The given batches, one per step, as they are (no collation)."""
    return DataLoader(batches, batch_size=None)


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0, **kwargs,
    )


class _GradProbe(Callback):
    """Keeps, after the backward of every step, which parameters have a finite gradient."""

    def __init__(self) -> None:
        self.finite: list[dict[str, bool]] = []

    def on_after_backward(self, trainer, pl_module) -> None:
        self.finite.append({
            name: p.grad is not None and bool(torch.isfinite(p.grad).all()) for name, p in pl_module.named_parameters()
        })


def test_an_all_ignored_training_batch_gives_a_zero_loss_and_finite_gradients():
    module = _module()
    probe = _GradProbe()
    trainer = _trainer(max_steps=1, callbacks=[probe])
    trainer.fit(module, train_dataloaders=_loader([_batch(1, ignored=True)]))
    torch.testing.assert_close(trainer.callback_metrics["train_loss"], torch.zeros(()), rtol=0, atol=0)
    assert probe.finite and all(probe.finite[0].values()), [n for n, ok in probe.finite[0].items() if not ok]
    for name, param in module.named_parameters():
        assert torch.isfinite(param).all(), name


def test_an_all_ignored_batch_leaves_the_validation_loss_and_perplexity_those_of_the_other_batches():
    module = _module().eval()
    batches = [_batch(2), _batch(3, ignored=True)]
    inputs, targets = batches[0]
    with torch.no_grad():
        expected = F.cross_entropy(module(inputs).flatten(0, 1).float(), targets.flatten())
    (metrics,) = _trainer().validate(module, dataloaders=_loader(batches), verbose=False)
    torch.testing.assert_close(torch.tensor(metrics["val_loss"]), expected)
    torch.testing.assert_close(torch.tensor(metrics["val_ppl"]), expected.exp(), rtol=1e-4, atol=0)
    assert math.isfinite(metrics["val_ppl"])


@pytest.mark.parametrize("shape", [(0, SEQ), (2, 0)], ids=["no-samples", "no-positions"])
@pytest.mark.parametrize("stage", ["training", "validation"])
def test_an_empty_batch_is_refused_with_its_shapes_and_likely_cause(stage, shape):
    module = _module()
    empty = torch.zeros(shape, dtype=torch.int64)
    step = module.training_step if stage == "training" else module.validation_step
    match = (
        rf"{stage} batch 3 is empty: inputs of shape \({shape[0]}, {shape[1]}\), targets of shape "
        rf"\({shape[0]}, {shape[1]}\).*data loader"
    )
    with pytest.raises(ValueError, match=match):
        step((empty, empty.clone()), 3)


def test_inputs_and_targets_of_different_shapes_are_refused():
    module = _module()
    inputs, targets = _batch(4)
    with pytest.raises(ValueError, match=r"inputs of shape \(2, 8\) and targets of shape \(2, 7\)"):
        module.training_step((inputs, targets[:, :-1]), 0)
