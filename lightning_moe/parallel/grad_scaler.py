"""One skip-or-step decision for all ranks under fp16 loss scaling, whatever each rank's shards hold.

``torch.amp.GradScaler`` checks the gradients *this rank* holds for inf/NaN after unscaling and
skips the optimizer step (and lowers the scale) if it finds any. Under data parallelism every
rank holds the same reduced gradients, so all ranks agree. Under expert (and tensor) parallelism
they do not: an overflow in one rank's experts would make that rank skip the step while the
others take it, and the replicated dense parameters, identical until then, silently diverge
(and so would the loss scales). Megatron all-reduces its ``found_inf`` flag over the model-
parallel ranks; :func:`agree_on_overflow` does the same for a GradScaler, over a process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["agree_on_overflow"]

_PATCHED = "_lightning_moe_agrees_on_overflow"


def agree_on_overflow(scaler: torch.amp.GradScaler, group: dist.ProcessGroup | None = None) -> None:
    """Make ``scaler`` skip a step on every rank of ``group`` (default: the world) if any rank overflowed.

    Wraps the scaler's ``unscale_`` (which ``step`` calls too when the loop did not): after it
    has recorded this rank's inf/NaN flags, they are summed over ``group`` in place (one small
    all-reduce per optimizer, on the flags' device, no host read), so ``step`` and ``update`` see
    the same decision everywhere. Every rank must step the same optimizers in the same order.
    Idempotent.
    """
    if getattr(scaler, _PATCHED, False) or not scaler.is_enabled():
        return
    unscale = scaler.unscale_

    def unscale_and_agree(optimizer: torch.optim.Optimizer) -> None:
        unscale(optimizer)
        # GradScaler keeps one flag tensor per device of the optimizer's gradients (private state,
        # stable since torch 1.6); a sum is non-zero exactly when some rank found an inf or NaN.
        for found_inf in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            dist.all_reduce(found_inf, group=group)

    scaler.unscale_ = unscale_and_agree
    setattr(scaler, _PATCHED, True)
