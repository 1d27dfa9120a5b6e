"""`StepSafeguards`: what `MoEStrategy` checks and sets around every training step.

* at setup: refuse ``detect_anomaly`` with tensor parallelism (DTensor cannot run its check),
  bind one aux-loss gradient scale to every router, and make the ranks agree on GradScaler
  overflows (expert shards differ per rank: :mod:`lightning_moe.parallel.grad_scaler`);
* per micro-batch: tensor-parallel ranks hold the same batch
  (:mod:`lightning_moe.parallel.batch_agreement`), compared on the device and read once per
  optimizer step under automatic optimization;
* before each backward: the aux/z-loss gradient scale follows the main loss's
  (:mod:`lightning_moe.layers.loss_scale`);
* before each optimizer step: the reduced gradients are finite
  (:class:`~lightning_moe.strategies.optimizer_step.GradientGuard`).

No Lightning import: the strategy passes in what these need.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_moe.layers.loss_scale import LossGradScale
from lightning_moe.parallel.batch_agreement import BatchAgreement, check_same_batch
from lightning_moe.parallel.grad_scaler import agree_on_overflow
from lightning_moe.parallel.layout.groups import ParallelContext
from lightning_moe.strategies.optimizer_step import GradientGuard

__all__ = ["StepSafeguards"]


class StepSafeguards:
    """Per-step checks and settings of one strategy (see the module docstring).

    Args:
        on_nonfinite_grads: the :class:`GradientGuard` policy, ``"raise"`` or ``"skip"``.
    """

    def __init__(self, on_nonfinite_grads: str = "raise") -> None:
        self.guard = GradientGuard(on_nonfinite_grads)
        self.loss_scale: LossGradScale | None = None
        self.batches = BatchAgreement()
        # The first training micro-batch is checked at once, before its forward (see observe_batch).
        self._first_batch_checked = False

    def setup(
        self, model: nn.Module, ctx: ParallelContext, device: torch.device,
        grad_scaler: torch.amp.GradScaler | None, detect_anomaly: bool,
    ) -> None:
        """Once the model is on ``device``: the checks and bindings that hold for the whole run."""
        tp = ctx.size("tp")
        if detect_anomaly and tp > 1:
            raise ValueError(
                f"Trainer(detect_anomaly=True) does not work with tensor_parallel_size={tp}: anomaly mode "
                "checks every gradient with an operation (aten._is_any_true) that DTensor, which shards the "
                "tensor-parallel weights, does not support. Debug the anomaly at tensor_parallel_size=1 "
                "(expert parallelism works with it), or turn it off."
            )
        self.loss_scale = LossGradScale(device)
        self.loss_scale.bind(model)
        if grad_scaler is not None:
            agree_on_overflow(grad_scaler)

    @staticmethod
    def check_batch(args: tuple, kwargs: dict[str, Any], ctx: ParallelContext) -> None:
        """TP ranks split each sequence between them, so they must hold the same batch.

        Megatron broadcasts the batch from TP rank 0; we check it (one small all-gather and one
        host read per call: validation and manual optimization) and name the likely cause.
        """
        if ctx.size("tp") > 1:
            check_same_batch(args[0] if args else kwargs.get("batch"), ctx.group("tp"))

    def observe_batch(self, args: tuple, kwargs: dict[str, Any], ctx: ParallelContext) -> None:
        """As :meth:`check_batch`, without the host read: compared on the device, read by :meth:`verify_batches`.

        The strategy's first training micro-batch is checked at once (one host read, once): a
        systematic difference (per-rank augmentation, another sequence length) is then refused
        before any forward, where mismatched tensors would meet in the TP collectives first.
        """
        if ctx.size("tp") <= 1:
            return
        if not self._first_batch_checked:
            self._first_batch_checked = True
            self.check_batch(args, kwargs, ctx)
            return
        self.batches.observe(args[0] if args else kwargs.get("batch"), ctx.group("tp"))

    def verify_batches(self) -> None:
        """Before the optimizer step: one host read of every :meth:`observe_batch` since the last step."""
        self.batches.verify()

    def before_backward(
        self, accumulation: int, ctx: ParallelContext, grad_scaler: torch.amp.GradScaler | None
    ) -> None:
        """Set the aux/z-loss gradient scale for this backward.

        Lightning divides the loss by ``accumulation`` (read every step:
        ``GradientAccumulationScheduler`` changes it) and 16-mixed multiplies it by the
        GradScaler's scale. The CP factor undoes the ``1/(DP*CP)`` pre-scale for losses that each
        CP rank holds only a share of (docs/numerics.md §5.4).
        """
        if self.loss_scale is not None:
            self.loss_scale.update(ctx.size("cp") / accumulation, grad_scaler)

    def before_optimizer_step(
        self, optimizer: torch.optim.Optimizer, ctx: ParallelContext, step: int,
        grad_scaler: torch.amp.GradScaler | None, log: Callable[[str, float], None],
    ) -> bool:
        """The reduced gradients are finite (see :meth:`GradientGuard.check`); returns whether to step."""
        return self.guard.check(optimizer, ctx, step, grad_scaler, log=log)
