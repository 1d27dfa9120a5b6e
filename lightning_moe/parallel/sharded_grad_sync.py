"""`ShardedGradSync`: gradient synchronisation of a model sharded by :func:`~lightning_moe.parallel.apply_fully_shard`.

FSDP2 reduce-scatters each unit's gradients during backward (summed, divided by ``DP * CP``), so
what is left here is the part FSDP2 does not know about, and the controls the strategy needs,
with the same interface as :class:`~lightning_moe.parallel.grad_sync.GradSync`:

* :meth:`no_sync` marks the backward passes of gradient accumulation (and of a pipeline
  schedule's micro-batches). By default they still reduce-scatter, each into the sharded
  gradients (which accumulate there), as torchtitan does: a rank holds its shard of the gradients
  plus, while a unit's backward runs, that unit's unsharded gradients, never the whole model's.
  With ``defer_gradient_reduction=True`` they do not (FSDP2's ``set_requires_gradient_sync(False)``):
  FSDP2 keeps every unit's unsharded gradients, ``DP`` (``EDP`` for experts) times the shard, until
  the next synchronised backward (or :meth:`reduce_accumulated`) reduce-scatters their sum, one
  reduce-scatter per unit and step instead of one per micro-batch;
* :meth:`finish` sums the gradients of the tensor-parallel-partial parameters
  (:func:`~lightning_moe.parallel.fully_shard.tp_partial_params`) over ``tp``, once per reduction:
  each TP rank routed its own tokens, and the TP ranks of one data-parallel coordinate hold the
  same FSDP shard, so an all-reduce of the local shards completes the sum. It runs after a
  synchronised backward armed by :meth:`begin_backward` / :meth:`end_backward` (on the shards
  every micro-batch of the step added to) and does nothing otherwise, so calling it twice never
  sums twice;
* :meth:`reduce_accumulated` completes the reduction of a :meth:`no_sync` window without another
  backward: a pipeline schedule runs every micro-batch's backward itself, so the deferred
  reduce-scatters are started here after the last one, as ``PipelineStage.perform_reduce_grad``
  does for an FSDP stage module (nothing is left to start when they were not deferred).

Unlike ``GradSync``, a backward outside the armed window still reduce-scatters (FSDP2's hooks
fire on every backward): such a backward must run on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe.compat import (
    fsdp_finish_root_backward,
    fsdp_param_groups,
    fsdp_root_states,
    fsdp_shared_states,
)
from lightning_moe.parallel.fully_shard import fully_sharded_modules, tp_partial_params
from lightning_moe.parallel.layout.groups import ParallelContext

__all__ = ["ShardedGradSync"]



class ShardedGradSync:
    """Controls FSDP2's reductions of ``model`` and completes the tensor-parallel sums (module docstring).

    Args:
        model: a model sharded by :func:`~lightning_moe.parallel.apply_fully_shard` (or whose
            pipeline stages were).
        ctx: its layout.
        defer_gradient_reduction: hold the reduce-scatters back inside :meth:`no_sync` (module
            docstring): one reduce-scatter per step instead of one per micro-batch, at the cost
            of keeping unsharded gradients (``DP`` times the shard) between micro-batches.
    """

    overlap = True
    """FSDP2 reduces during backward, unit by unit."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, defer_gradient_reduction: bool = False) -> None:
        self.model = model
        self.ctx = ctx
        self.defer_gradient_reduction = defer_gradient_reduction
        self.units = fully_sharded_modules(model)
        if not self.units:
            raise ValueError("ShardedGradSync needs a model sharded by apply_fully_shard (no fully_shard unit found).")
        self._sync = True
        self._armed = False
        self._pending = False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of gradient accumulation: reduced at once, or deferred with ``defer_gradient_reduction``."""
        previous = self._sync
        self._set_sync(False)
        try:
            yield
        finally:
            self._set_sync(previous)

    def _set_sync(self, enabled: bool) -> None:
        self._sync = enabled
        if self.defer_gradient_reduction:
            for unit in self.units:
                unit.set_requires_gradient_sync(enabled, recurse=False)

    @property
    def sync_enabled(self) -> bool:
        """False inside :meth:`no_sync`."""
        return self._sync

    def begin_backward(self) -> None:
        """The strategy's training backward starts."""
        self._armed = True

    def end_backward(self) -> None:
        """The strategy's training backward ended: a synchronised one leaves a TP sum to do."""
        if self._armed and self._sync:
            self._pending = True
        self._armed = False

    @torch.no_grad()
    def reduce_accumulated(self) -> None:
        """Reduce-scatter the gradients deferred under :meth:`no_sync` now; :meth:`finish` then sums over ``tp``.

        Call outside :meth:`no_sync`, after the backward passes, on every rank of the units'
        meshes. With deferred reductions every unit that took part in them runs FSDP2's
        ``post_backward`` (idempotent: a unit without gradients does nothing), then each root's
        end-of-backward callback waits for the reductions and resets the units for the next step.
        """
        if not self._sync:
            raise RuntimeError("ShardedGradSync.reduce_accumulated() was called inside no_sync(); call it after.")
        if self.defer_gradient_reduction:
            # A root outside self.units (a pipeline stage module) is found too: roots share state contexts.
            for root in fsdp_root_states(self.units):
                for state in fsdp_shared_states(root):
                    for group in fsdp_param_groups(state):
                        group.post_backward()
                fsdp_finish_root_backward(root)
        self._pending = True

    @torch.no_grad()
    def finish(self) -> None:
        """Sum the TP-partial gradients over ``tp`` if a reduction happened since the last call."""
        if not self._pending:
            return
        self._pending = False
        if self.ctx.size("tp") == 1:
            return
        grads = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in tp_partial_params(self.model) if p.grad is not None
        ]
        # One all-reduce per dtype instead of one per parameter (a router and a shared expert in
        # every MoE layer would otherwise cost a collective each).
        for dtype in dict.fromkeys(g.dtype for g in grads):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=self.ctx.group("tp"))
            for grad, piece in zip(same, flat.split([g.numel() for g in same])):
                grad.copy_(piece.view_as(grad))

    def remove_hooks(self) -> None:
        """Nothing to remove: FSDP2 owns its hooks (kept for the ``GradSync`` interface)."""
