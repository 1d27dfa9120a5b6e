"""`TargetWeightedLoss` on one process: the weighted micro-batch losses average to the batch's token mean.

Oracle: the mean cross-entropy over every kept target of the whole batch, computed directly. The
pipeline runs with it are tested in ``tests/strategies/test_pipeline_parity.py`` (PP=2 equals one
process on the whole batch) and ``test_context_parallel_pipeline.py`` (CP x PP).
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.models.transformer import next_token_loss
from lightning_moe.parallel.pipeline.loss import TargetWeightedLoss

IGNORE, M, V = -100, 4, 16


def _weighted(targets: torch.Tensor) -> TargetWeightedLoss:
    return TargetWeightedLoss(lambda out, t: next_token_loss(out, t, IGNORE), lambda t: (t != IGNORE).sum(), M)


def test_the_mean_of_the_weighted_losses_is_the_token_mean_of_the_batch():
    logits = torch.randn(8, 5, V, generator=torch.Generator().manual_seed(0), requires_grad=True)
    targets = torch.randint(0, V, (8, 5), generator=torch.Generator().manual_seed(1))
    targets[:2] = IGNORE  # micro-batch 0: no target
    targets[2, 1:] = IGNORE
    targets[3] = IGNORE  # micro-batch 1: one target
    weighted = _weighted(targets)
    weighted.start(targets)
    losses = [weighted(out, t) for out, t in zip(logits.tensor_split(M), targets.tensor_split(M))]
    weighted.finish()
    torch.testing.assert_close(torch.stack(losses).mean(), next_token_loss(logits, targets, IGNORE))
    assert losses[0].item() == 0.0


def test_a_batch_without_targets_gives_zero_and_calls_are_checked():
    targets = torch.full((4, 3), IGNORE)
    weighted = _weighted(targets)
    with pytest.raises(RuntimeError, match=r"called 1 times for 4 micro-batches; call start\(targets\)"):
        weighted(torch.zeros(1, 3, V), targets[:1])
    weighted.start(targets)
    assert weighted(torch.zeros(1, 3, V), targets[:1]).item() == 0.0
    with pytest.raises(RuntimeError, match="computed 1 losses for 4 micro-batches"):
        weighted.finish()
