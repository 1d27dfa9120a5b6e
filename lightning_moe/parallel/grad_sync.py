"""Gradient synchronisation for a folded layout: dense and expert gradients, in buckets.

Every gradient is pre-scaled by ``1 / (DP * CP)`` (the dense data-parallel world) and then summed
(reference ``megatron-core-moe.md`` section 2.11):

* expert parameters (tagged by ``apply_expert_parallel``) over the expert-data-parallel group
  ``edp``: each expert replica already summed the token gradients of its whole EP group through
  the all-to-all, so summing over EDP covers every DP x CP data shard exactly once;
* dense parameters replicated across TP over ``tp_dp_cp``: under folding every rank of a TP group
  routes its own tokens (sequence parallel), so a router, a norm or a replicated shared expert
  holds a partial gradient on each TP rank (sequence-parallel DTensor norms report theirs as
  ``Partial``; one that arrives already reduced is divided by TP first);
* dense parameters sharded by tensor parallelism (DTensors with a ``Shard`` placement) over
  ``dp_cp`` only; a gradient with another layout is first brought to the parameter's.

Reduction overlaps the backward pass: a post-accumulate-grad hook marks each parameter ready and
a bucket is launched (asynchronously) as soon as it and every bucket before it are ready, so all
ranks launch collectives in the same order whatever order their hooks fire in. Inside
:meth:`GradSync.no_sync` (gradient accumulation) nothing is launched; :meth:`GradSync.finish`
launches what is left, waits, and writes the reduced gradients back. ``finish`` does nothing when
no gradient arrived since the last one, so calling it twice never reduces twice. With
``overlap=False`` (manual optimization, where several backward passes may precede one step)
every reduction waits for ``finish``. A parameter without a gradient on this rank contributes
zeros; one without a gradient on any rank keeps ``grad=None`` (a flag travels with each bucket).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Shard

from lightning_moe.parallel.context import ParallelContext
from lightning_moe.parallel.expert_parallel import is_expert_param

__all__ = ["GradSync", "reduce_group_name"]


def reduce_group_name(param: Tensor) -> str:
    """The group a parameter's gradient is summed over (see the module docstring)."""
    if is_expert_param(param):
        return "edp"
    if isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements):
        return "dp_cp"
    return "tp_dp_cp"


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_grad(param: Tensor, tp_size: int) -> Tensor:
    """This rank's contribution to the sum of ``param``'s gradient, in the parameter's local shape."""
    grad = param.grad
    if not isinstance(grad, DTensor):
        return grad
    if any(isinstance(p, Partial) for p in grad.placements):
        return grad.to_local()  # a partial sum: exactly what the reduction adds up
    if isinstance(param, DTensor) and grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)  # e.g. Replicate -> Shard: a slice
    local = grad.to_local()
    if reduce_group_name(param) == "tp_dp_cp" and tp_size > 1:
        local = local / tp_size  # already summed over TP; the reduction below sums it again
    return local


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    group_name: str
    dtype: torch.dtype
    ready: set[int] = field(default_factory=set)
    flat: Tensor | None = None
    handle: object | None = None

    def is_ready(self) -> bool:
        return len(self.ready) == len(self.params)


class GradSync:
    """Bucketed, overlapped gradient reduction of one module over the groups of a `ParallelContext`."""

    def __init__(
        self, module: nn.Module, ctx: ParallelContext, bucket_size_mb: float = 25.0, overlap: bool = True
    ) -> None:
        self.ctx = ctx
        self.scale = 1.0 / (ctx.size("dp") * ctx.size("cp"))
        self.overlap = overlap
        """Launch buckets during backward (False: everything in :meth:`finish`)."""
        self._sync_enabled = True
        self._pending = False
        self._next_launch = 0
        self.buckets = self._make_buckets(module, int(bucket_size_mb * 2**20))
        self._bucket_of = {id(p): (i, j) for i, b in enumerate(self.buckets) for j, p in enumerate(b.params)}
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
            for b in self.buckets
            for p in b.params
        ]

    def _make_buckets(self, module: nn.Module, cap_bytes: int) -> list[_Bucket]:
        # Reverse registration order approximates the order in which backward produces gradients.
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        buckets: list[_Bucket] = []
        open_buckets: dict[tuple[str, torch.dtype], _Bucket] = {}
        sizes: dict[tuple[str, torch.dtype], int] = {}
        for p in params:
            key = (reduce_group_name(p), _local(p).dtype)  # one group and one dtype per flat buffer
            nbytes = _local(p).numel() * _local(p).element_size()
            bucket = open_buckets.get(key)
            if bucket is None or sizes[key] + nbytes > cap_bytes:
                bucket = _Bucket([], *key)
                buckets.append(bucket)
                open_buckets[key], sizes[key] = bucket, 0
            bucket.params.append(p)
            sizes[key] += nbytes
        return buckets

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no collectives) inside this context."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    @property
    def sync_enabled(self) -> bool:
        """False inside :meth:`no_sync`."""
        return self._sync_enabled

    def _on_grad_ready(self, param: Tensor) -> None:
        self._pending = True
        if not (self._sync_enabled and self.overlap):
            return
        i, j = self._bucket_of[id(param)]
        self.buckets[i].ready.add(j)
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].is_ready():
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        pieces = []
        tp = self.ctx.size("tp")
        for p in bucket.params:
            local = _local(p)
            pieces.append(torch.zeros(local.numel(), dtype=bucket.dtype, device=local.device)
                          if p.grad is None else _local_grad(p, tp).reshape(-1).to(bucket.dtype))
        # One flag per parameter after the gradients: how many ranks had a gradient for it.
        flags = torch.tensor([p.grad is not None for p in bucket.params], dtype=bucket.dtype, device=pieces[0].device)
        bucket.flat = torch.cat([*pieces, flags])
        bucket.flat[: bucket.flat.numel() - flags.numel()].mul_(self.scale)
        if self.ctx.size(bucket.group_name) > 1:
            bucket.handle = dist.all_reduce(bucket.flat, group=self.ctx.group(bucket.group_name), async_op=True)

    def finish(self) -> None:
        """Launch the remaining buckets, wait for all of them and write the reduced gradients back.

        A no-op when no gradient arrived since the last call (every rank must agree on that: call
        it on all ranks after the same backward passes).
        """
        if not self._pending:
            return
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            offset = 0
            flags = bucket.flat[bucket.flat.numel() - len(bucket.params) :].tolist()
            for p, had_grad in zip(bucket.params, flags):
                local = _local(p)
                reduced = bucket.flat[offset : offset + local.numel()].view_as(local).to(local.dtype)
                offset += local.numel()
                if not had_grad:
                    continue  # no rank produced a gradient: keep None, as the optimizer expects
                if isinstance(p, DTensor):
                    # Replace the gradient: its layout may have differed (Partial, Replicate) from the parameter's.
                    p.grad = DTensor.from_local(reduced.clone(), p.device_mesh, p.placements, run_check=False)
                elif p.grad is None:
                    p.grad = reduced.clone()
                else:
                    p.grad.copy_(reduced)
            bucket.ready.clear()
            bucket.flat = bucket.handle = None
        self._next_launch = 0
        self._pending = False

    def remove_hooks(self) -> None:
        """Detach from the module's parameters."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
