"""The gradient-synchronisation protocol the strategy and the pipeline runner drive.

Two implementations: :class:`~lightning_moe.parallel.grad_sync.GradSync` (replicated parameters:
bucketed all-reduces, overlapped with backward) and
:class:`~lightning_moe.parallel.sharded_grad_sync.ShardedGradSync` (FSDP2: its reduce-scatters,
then the tensor-parallel sums). The caller's sequence for one optimizer step is the same for both::

    for micro_batch in accumulated:           # all but the last
        with sync.no_sync():                  # accumulate, reduce later
            sync.begin_backward(); loss.backward(); sync.end_backward()
    sync.begin_backward(); loss.backward(); sync.end_backward()
    sync.finish()                             # gradients now reduced (idempotent)

``reduce_accumulated()`` starts, after backward passes run under ``no_sync``, the reductions they
held back (the pipeline runs its whole schedule that way); ``remove_hooks()`` detaches for good.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

__all__ = ["GradientSync"]


@runtime_checkable
class GradientSync(Protocol):
    """What a gradient synchronisation offers its driver (the strategy, the pipeline runner)."""

    @property
    def overlap(self) -> bool:
        """Reductions run during backward, so the driver finishes them right after one that syncs."""
        ...

    @property
    def sync_enabled(self) -> bool:
        """False inside :meth:`no_sync`."""
        ...

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside accumulate gradients; their reduction waits for a later one."""
        ...

    def begin_backward(self) -> None:
        """A backward pass the synchronisation must act on starts (others are left alone)."""
        ...

    def end_backward(self) -> None:
        """That backward pass ended."""
        ...

    def reduce_accumulated(self) -> None:
        """Start, outside :meth:`no_sync`, the reductions held back by backward passes inside it."""
        ...

    def finish(self) -> None:
        """Complete every reduction since the last call (a no-op when there was none); call on all ranks."""
        ...

    def remove_hooks(self) -> None:
        """Detach from the model's parameters for good."""
        ...
