"""`TargetWeightedLoss`: a pipeline's micro-batch losses weighed so the batch loss is a mean per target.

A pipeline schedule computes one loss per micro-batch and divides every gradient by the number of
micro-batches ``M`` (``scale_grads``): each micro-batch counts ``1/M``, however many targets it
keeps. With a loss that is a mean over the kept targets (ignored padding, a document's end) that is
not the loss of the whole batch: a micro-batch with one kept target weighs as much as a full one,
and one with none (loss 0) dilutes the others. Weighing micro-batch ``m``'s mean loss by
``M * n_m / N`` (``n_m`` its targets, ``N`` the batch's) makes the schedule's ``1/M``-weighted sum
the mean over every target of the batch, the loss at PP=1; the logged mean of the weighted losses
is that mean too.

Under context parallelism the counts are the whole sequences' (summed over ``cp``), matching a
``loss_fn`` that returns this CP rank's share of the whole-sequence mean
(:func:`~lightning_moe.parallel.context_parallel.apply.cp_token_mean`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["TargetWeightedLoss"]


class TargetWeightedLoss:
    """``loss_fn`` of one micro-batch, weighed by its share of the batch's targets (module docstring).

    Call :meth:`start` with the whole batch's targets before each schedule step, on the ranks of
    the last stage; the schedule then calls the object once per micro-batch, in micro-batch order
    (torch's schedules themselves look a micro-batch's loss up by that order), and :meth:`finish`
    checks that it did.

    Args:
        loss_fn: ``(outputs, targets) -> mean loss`` of one micro-batch (0 without targets).
        num_targets: ``targets -> number of targets kept`` (a 0-d integer tensor on the device).
        num_microbatches: ``M``, the micro-batches per batch.
        cp_group: the context-parallel group when CP > 1 (counts are summed over it), else None.
    """

    def __init__(
        self, loss_fn: Callable[[Tensor, Tensor], Tensor], num_targets: Callable[[Tensor], Tensor],
        num_microbatches: int, cp_group=None,
    ) -> None:
        self.loss_fn = loss_fn
        self.num_targets = num_targets
        self.num_microbatches = num_microbatches
        self.cp_group = cp_group
        self._weights: Tensor | None = None
        self._calls = 0

    def start(self, targets: Tensor) -> None:
        """Count the targets of each of the ``M`` micro-batches of ``targets`` (device tensors, no host read)."""
        counts = torch.stack([
            torch.as_tensor(self.num_targets(chunk), device=targets.device).reshape(())
            for chunk in targets.tensor_split(self.num_microbatches)
        ]).float()
        if self.cp_group is not None:  # one collective for all micro-batches: the whole sequences' counts
            dist.all_reduce(counts, group=self.cp_group)
        # A batch without targets: every weight 0, the loss 0 (as at PP=1).
        self._weights = counts * self.num_microbatches / counts.sum().clamp(min=1)
        self._calls = 0

    def __call__(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Micro-batch ``m``'s loss times ``M * n_m / N`` (``m``: how many micro-batches came before)."""
        if self._weights is None or self._calls >= self.num_microbatches:
            raise RuntimeError(
                f"TargetWeightedLoss called {self._calls + 1} times for {self.num_microbatches} micro-batches; "
                "call start(targets) before each schedule step."
            )
        weight = self._weights[self._calls]
        self._calls += 1
        loss = self.loss_fn(outputs, targets)
        return loss * weight.to(loss.dtype)

    def finish(self) -> None:
        """Check that the step computed every micro-batch's loss once, and forget the weights."""
        calls, self._weights, self._calls = self._calls, None, 0
        if calls != self.num_microbatches:
            raise RuntimeError(
                f"The pipeline schedule computed {calls} losses for {self.num_microbatches} micro-batches; "
                "the micro-batch weights no longer match their losses."
            )
