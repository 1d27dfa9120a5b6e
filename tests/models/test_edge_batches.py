"""`MoETransformer` on edge batches: all targets ignored, and empty batches.

Oracles: ``F.cross_entropy`` (mean over the targets that are not ignored) where there is a
target; 0 with zero gradients where there is none; a ``ValueError`` naming the shapes and the
likely cause for a batch without samples or without positions.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.models.transformer import next_token_loss

VOCAB, HIDDEN = 64, 32
IGNORE = -100


def _model(**moe) -> MoETransformer:
    torch.manual_seed(0)
    config = MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=2, num_attention_heads=4, num_kv_heads=2,
        ffn_hidden_size=64, max_seq_len=16, first_dense_layers=1,
        moe=MoEConfig(HIDDEN, 16, 4, top_k=2, **moe),
    )
    return MoETransformer(config)


def _tokens(shape, seed=1) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_next_token_loss_is_the_mean_over_the_targets_kept():
    logits = torch.randn(2, 5, VOCAB, generator=torch.Generator().manual_seed(2))
    targets = _tokens((2, 5))
    targets[0, 1:4] = IGNORE
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    torch.testing.assert_close(next_token_loss(logits, targets, IGNORE), expected)
    torch.testing.assert_close(next_token_loss(logits.bfloat16(), targets, IGNORE), expected, atol=2e-2, rtol=0)
    assert next_token_loss(logits.bfloat16(), targets, IGNORE).dtype == torch.float32


@pytest.mark.parametrize("losses", [{}, {"load_balancing": ["aux_loss"], "aux_loss_coeff": 1e-2, "z_loss_coeff": 1e-3}],
                         ids=["no-router-losses", "router-losses"])
def test_all_ignored_targets_give_zero_loss_and_reach_every_parameter(losses):
    model = _model(**losses).train()
    for layer in model.modules():
        if hasattr(layer, "aux_loss_scale"):
            layer.aux_loss_scale = 1.0
    tokens = _tokens((2, 8))
    targets = torch.full_like(tokens, IGNORE)
    loss = model.loss(tokens, targets, ignore_index=IGNORE)
    torch.testing.assert_close(loss, torch.zeros(()), rtol=0, atol=0)
    assert loss.requires_grad, "the zero loss must stay connected to the graph (DDP reduces every grad)"
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(param.grad).all(), name
        if not losses:
            # Without router losses (they reach the router and everything below it) nothing moves.
            torch.testing.assert_close(param.grad, torch.zeros_like(param.grad), rtol=0, atol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("shape", [(0, 8), (2, 0), (0, 0)], ids=["no-samples", "no-positions", "nothing"])
def test_an_empty_batch_is_refused_with_its_shape_and_likely_cause(shape):
    model = _model()
    tokens = torch.zeros(shape, dtype=torch.int64)
    match = rf"empty batch: tokens of shape \({shape[0]}, {shape[1]}\).*data loader"
    with pytest.raises(ValueError, match=match):
        model(tokens)
    with pytest.raises(ValueError, match=match):
        model.loss(tokens, tokens)
