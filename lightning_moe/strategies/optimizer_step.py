"""What `MoEStrategy` does between the reduced gradients and the optimizer step.

* :class:`GradientGuard`: the global gradient norm (the one clipping uses, identical on every rank)
  is computed before every step; when it is not finite the step is refused: by default with
  :class:`NonFiniteGradientsError`, so that weights, and the checkpoints written from them, stay
  finite, or skipped (``on_nonfinite_grads="skip"``: every gradient dropped, so the optimizer
  changes nothing; counted in the logged metric ``moe/skipped_steps``). Under a GradScaler
  (``16-mixed``) overflows are expected and the scaler skips those steps itself, so the guard
  stands aside.
* :func:`patch_gradient_clipping`: Lightning clips through the precision plugin with each rank's
  local norm; norm clipping is routed to the global norm instead. It reuses the norm the guard
  computed when the gradients are still the same tensors at the same versions (nothing, e.g. a
  callback's ``on_before_optimizer_step``, changed them in between), so a clipped step costs one
  pass over the gradients and one reduction, not two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_moe.compat import tensor_version
from lightning_moe.parallel.grad_norm import clip_grad_norm_, global_grad_norm
from lightning_moe.parallel.layout.groups import ParallelContext

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
        self._last: tuple[tuple, Tensor] | None = None  # (gradient versions, their global norm)

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
        self._last = (_versions(params), norm)
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
        self._last = None
        self.skipped_steps += 1
        if log is not None:
            log(SKIPPED_STEPS_METRIC, float(self.skipped_steps))
        return False


    def norm_of(self, params: list[Tensor]) -> Tensor | None:
        """The norm :meth:`check` computed, if ``params``' gradients are exactly those it saw."""
        if self._last is None or self._last[0] != _versions(params):
            return None
        return self._last[1]


def _versions(params: list[Tensor]) -> tuple:
    # Which gradient tensors, at which in-place version: any change to them changes this.
    return tuple((id(p.grad), tensor_version(_local(p.grad))) for p in params)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def patch_gradient_clipping(
    plugin, ctx_of: Callable[[], ParallelContext], finish: Callable[[], None], guard: GradientGuard
) -> None:
    """Make ``plugin`` clip by the global norm over every shard (idempotent).

    ``finish`` reduces pending gradients first (manual optimization may clip before stepping);
    ``guard``'s norm of the same gradients is reused (see the module docstring).
    """
    if getattr(plugin, "_lightning_moe_clipping", False):
        return

    def clip_grad_by_norm(optimizer, clip_val):
        finish()
        params = _grads(optimizer)
        clip_grad_norm_(params, float(clip_val), ctx_of(), norm=guard.norm_of(params))

    plugin.clip_grad_by_norm = clip_grad_by_norm
    plugin._lightning_moe_clipping = True
