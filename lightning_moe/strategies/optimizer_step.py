"""What `MoEStrategy` does between the reduced gradients and the optimizer step.

* :class:`GradientGuard`: the global gradient norm (the one clipping uses, identical on every rank)
  is computed before every step; when it is not finite the step is refused: by default with
  :class:`NonFiniteGradientsError`, so that weights, and the checkpoints written from them, stay
  finite, or skipped (``on_nonfinite_grads="skip"``: every gradient dropped, so the optimizer
  changes nothing; counted in the logged metric ``moe/skipped_steps``). Under a GradScaler
  (``16-mixed``) overflows are expected and the scaler skips those steps itself, so the guard
  stands aside. (Clipping computes the norm again: callbacks may change the gradients between
  the two, in ``on_before_optimizer_step``.)
* :func:`patch_gradient_clipping`: Lightning clips through the precision plugin with each rank's
  local norm; norm clipping is routed to the global norm instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_moe.parallel.context import ParallelContext
from lightning_moe.parallel.grad_norm import clip_grad_norm_, global_grad_norm

__all__ = ["NONFINITE_POLICIES", "GradientGuard", "NonFiniteGradientsError", "patch_gradient_clipping"]

NONFINITE_POLICIES = ("raise", "skip")
"""Values of ``MoEStrategy(on_nonfinite_grads=...)``."""

SKIPPED_STEPS_METRIC = "moe/skipped_steps"


class NonFiniteGradientsError(FloatingPointError):
    """The reduced gradients of a step hold inf or NaN; the optimizer step was not taken."""


def _grads(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


class GradientGuard:
    """Refuses or skips optimizer steps whose gradients are not finite (see the module docstring).

    Args:
        policy: ``"raise"`` or ``"skip"``.
    """

    def __init__(self, policy: str = "raise") -> None:
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite_grads={policy!r}; choose one of {list(NONFINITE_POLICIES)}.")
        self.policy = policy
        self.skipped_steps = 0
        """Steps skipped since the guard was made (``"skip"`` policy)."""

    def check(
        self, optimizer: torch.optim.Optimizer, ctx: ParallelContext, step: int,
        grad_scaler: torch.amp.GradScaler | None = None, log: Callable[[str, float], None] | None = None,
    ) -> bool:
        """Check ``optimizer``'s reduced gradients before step ``step``; returns whether to step.

        Collective over the shard groups (the global norm), with one host read of it. Raises
        :class:`NonFiniteGradientsError` under the ``"raise"`` policy; under ``"skip"`` drops every
        gradient (``grad = None``: the optimizer then changes nothing) and reports the count
        through ``log``.
        """
        if grad_scaler is not None and grad_scaler.is_enabled():
            return True  # overflows are the GradScaler's business: it skips those steps itself
        params = _grads(optimizer)
        norm = global_grad_norm(params, ctx)
        if bool(torch.isfinite(norm)):  # the one host read
            return True
        if self.policy == "raise":
            raise NonFiniteGradientsError(
                f"Step {step}: the gradients are not finite (global gradient norm {norm.item()}); the "
                "optimizer step was not taken, so the weights and the checkpoints on disk stay finite. Look for "
                "the source (a learning rate too high, a bad batch, an input with inf/NaN; "
                "Trainer(detect_anomaly=True) names the operation at TP=1), or pass "
                "MoEStrategy(on_nonfinite_grads='skip') to skip such steps, counted in the logged metric "
                f"{SKIPPED_STEPS_METRIC!r}."
            )
        for p in params:
            p.grad = None
        self.skipped_steps += 1
        if log is not None:
            log(SKIPPED_STEPS_METRIC, float(self.skipped_steps))
        return False


def patch_gradient_clipping(plugin, ctx_of: Callable[[], ParallelContext], finish: Callable[[], None]) -> None:
    """Make ``plugin`` clip by the global norm over every shard (idempotent).

    ``finish`` reduces pending gradients first (manual optimization may clip before stepping).
    """
    if getattr(plugin, "_lightning_moe_clipping", False):
        return

    def clip_grad_by_norm(optimizer, clip_val):
        finish()
        clip_grad_norm_(_grads(optimizer), float(clip_val), ctx_of())

    plugin.clip_grad_by_norm = clip_grad_by_norm
    plugin._lightning_moe_clipping = True
