"""Token-weighted validation metrics: ``val_loss`` / ``test_loss`` and ``val_ppl`` / ``test_ppl``."""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["TokenMeanLoss", "TokenPerplexity"]


class TokenMeanLoss(Metric):
    """Mean loss per target token over every batch (and rank) seen, for ``val_loss``.

    ``update(mean_loss, num_targets)`` adds one batch (0-d tensors) or several micro-batches (1-d
    tensors of one length: each micro-batch's mean loss and targets). Weighting by the targets
    kept, as the perplexity does, keeps a batch without any target (its loss is 0, see
    :func:`~lightning_moe.models.transformer.next_token_loss`) from pulling the mean down, so
    ``val_ppl`` is ``exp(val_loss)`` up to rounding. NaN only when no batch had a target.
    """

    full_state_update = False
    higher_is_better = False
    is_differentiable = False

    loss_sum: Tensor
    num_targets: Tensor

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("loss_sum", torch.zeros((), dtype=torch.float32), dist_reduce_fx="sum")
        self.add_state("num_targets", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, mean_loss: Tensor, num_targets: Tensor) -> None:
        """Add one batch's mean loss over its ``num_targets`` targets, or several micro-batches' (1-d
        tensors), as device tensors (no host read)."""
        self.loss_sum += (mean_loss.detach().float() * num_targets).sum()
        self.num_targets += num_targets.sum()

    def compute(self) -> Tensor:
        """The token-weighted mean loss (fp32; NaN when no batch had a target)."""
        return self.loss_sum / self.num_targets


class TokenPerplexity(TokenMeanLoss):
    """``exp`` of :class:`TokenMeanLoss`, for ``val_ppl`` and ``test_ppl``: torchmetrics' ``Perplexity``
    up to rounding, but from the losses, so it needs no logits (a pipeline's micro-batch losses are
    all that reach every rank; tensor parallelism keeps the logits sharded over the vocabulary).
    NaN only when no batch had a target."""

    def compute(self) -> Tensor:
        """``exp`` of the token-weighted mean loss (fp32)."""
        return super().compute().exp()
