"""Gradient synchronisation for a folded layout: dense and expert gradients, in buckets.

Every gradient is pre-scaled by ``1 / (DP * CP)`` (the dense data-parallel world) and then summed
(docs/numerics.md §11):

* expert parameters (tagged by ``apply_expert_parallel``) over the expert-data-parallel group
  ``edp``: each expert replica already summed the token gradients of its whole EP group through
  the all-to-all, so summing over EDP covers every DP x CP data shard exactly once;
* dense parameters replicated across TP over ``tp_dp_cp``: under folding every rank of a TP group
  routes its own tokens (sequence parallel), so a router, a norm or a replicated shared expert
  holds a partial gradient on each TP rank (sequence-parallel DTensor norms report theirs as
  ``Partial``; one that arrives already reduced is divided by TP first);
* dense parameters sharded by tensor parallelism (DTensors with a ``Shard`` placement) over
  ``dp_cp`` only; a gradient with another layout is first brought to the parameter's;
* plain parameters of a model's own tensor parallelism that every TP rank computes whole (outside
  its MoE layers: :func:`~lightning_moe.parallel.user_tensor_parallel.tp_replicated_params`) over
  ``dp_cp`` only.

Gradients live in persistent bucket buffers, one flat tensor per bucket (one group, one dtype),
allocated at the first backward: ``param.grad`` is a view of its slot, as with DDP's
``gradient_as_bucket_view`` and Megatron's grad buffers, so the reduction works in place and the
module holds one copy of its gradients. The first gradient of a step (``param.grad`` was None
after ``zero_grad(set_to_none=True)``, Lightning's default) is copied into its slot and
``param.grad`` becomes the view (a DTensor parameter's gradient: the view wrapped with
``DTensor.from_local``; a tensor-replicated one is held as ``Partial`` until reduced, so that
later micro-batches add their partial sums in place); later micro-batches accumulate into the
view in place and ``zero_grad(set_to_none=False)`` zeroes it. After the all-reduce nothing is
written back. That one copy per parameter and step is the cheapest way into a flat buffer for a
gradient autograd allocated: keeping the views through ``zero_grad`` instead would zero the
buffer and add the new gradient to it (Megatron's grad buffer without its fused weight-gradient
kernels), more memory traffic for the same result. Expert weights under the per-expert loop kernel
(CPU, fp32, GPUs before Hopper) skip that copy: the kernel writes the gradient straight into the
slot (``GroupedExperts.place_weight_grad``, once the buckets exist), which is also the memory it
reuses from step to step; ``grouped_mm``'s gradients come from autograd and are copied like the
dense ones. Nothing else is allocated or copied per step in fp32 (the vocab-parallel embedding's
gradient arrives as this rank's rows, like the other sharded ones); narrower gradients add the
fp32 staging copies described next.

Parameters narrower than fp32 (``bf16-true``, ``16-true``) are reduced in fp32 by default, as
Megatron's ``grad_reduce_in_fp32``: at its launch a bucket is copied to fp32, pre-scaled and summed
there, and rounded once, back into its slots, when it is waited for; summed in bf16 instead, every
step of the ring rounds (at four ranks a quarter of the elements then miss the correctly rounded
mean: tests/parallel/test_grad_sync_reduce.py). At most `FP32_BUCKETS_IN_FLIGHT` buckets are held
in fp32 at a time: launching one more first waits for the oldest, so the transient is two buckets
in fp32 (4 x ``bucket_size_mb`` MiB for bf16), not an fp32 copy of every gradient. Micro-batches still accumulate in the parameter's dtype (``param.grad``
has it); Megatron also accumulates in fp32, in a persistent fp32 buffer twice the gradients'
size. ``grad_reduce_in_fp32=False`` reduces in the parameter dtype.

Reduction overlaps the backward pass: a post-accumulate-grad hook marks each parameter ready and
a bucket is launched (asynchronously) as soon as it and every bucket before it are ready, so all
ranks launch collectives in the same order whatever order their hooks fire in. Inside
:meth:`GradSync.no_sync` (gradient accumulation) nothing is launched; :meth:`GradSync.finish`
launches what is left and waits. ``finish`` does nothing when no gradient arrived since the last
one, so calling it twice never reduces twice. With ``overlap=False`` (manual optimization, where
several backward passes may precede one step) every reduction waits for ``finish``. A parameter
without a gradient on this rank contributes zeros; one without a gradient on any rank keeps
``grad=None``: a flag per parameter travels at the end of each bucket, written on the device, and
is read back (one device-to-host copy per ``finish``) only if some parameter had no gradient here.

With ``explicit_backward=True`` the hooks act only between :meth:`GradSync.begin_backward` and
:meth:`GradSync.end_backward` (the strategy arms them around Lightning's training backward). A
backward outside that window (a callback's probe, a validation step under
``torch.enable_grad()``) launches nothing, marks nothing and makes no later ``finish`` reduce; its
gradients accumulate into ``param.grad`` as autograd does, into the bucket view where it is one.
They count in the next reduction unless zeroed first: Lightning's loop zeroes the gradients before
every training backward that starts an accumulation window, so a probe between optimizer steps is
dropped, while one between the micro-batches of an accumulation window adds to them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_moe.parallel.expert_parallel import is_expert_param
from lightning_moe.parallel.layout.groups import ParallelContext
from lightning_moe.parallel.user_tensor_parallel import tp_replicated_params

__all__ = ["FP32_BUCKETS_IN_FLIGHT", "GradSync", "reduce_group_name"]

FP32_BUCKETS_IN_FLIGHT = 2
"""Buckets held in fp32 at once while narrower gradients are reduced in fp32 (module docstring)."""


def reduce_group_name(param: Tensor, tp_replicated: bool = False) -> str:
    """The group a parameter's gradient is summed over (see the module docstring); ``tp_replicated``:
    a plain parameter whose whole gradient every TP rank holds."""
    if is_expert_param(param):
        return "edp"
    if tp_replicated or (isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements)):
        return "dp_cp"
    return "tp_dp_cp"


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _land_grad(param: Tensor, slot: Tensor, tp_size: int) -> None:
    """Write this rank's contribution to the sum of ``param``'s gradient into ``slot`` (one pass)."""
    grad = param.grad
    if not isinstance(grad, DTensor):
        slot.copy_(grad)
        return
    replicated = reduce_group_name(param) == "tp_dp_cp"
    if replicated and any(isinstance(p, Partial) for p in grad.placements):
        slot.copy_(grad.to_local())  # a partial sum: exactly what the reduction adds up
        return
    if isinstance(param, DTensor) and grad.placements != param.placements:
        # Not on the reference model's plan, whose sharded parameters get gradients of their own
        # layout (its vocab-parallel embedding included); e.g. Partial -> Shard: a reduce-scatter.
        local = grad.redistribute(param.device_mesh, param.placements).to_local()
    else:
        local = grad.to_local()
    if replicated and tp_size > 1:
        torch.div(local, tp_size, out=slot)  # already summed over TP; the reduction sums it again
    else:
        slot.copy_(local)


def _accumulating_placements(param: Tensor) -> tuple | None:
    """Layout of a DTensor gradient between its first micro-batch and the reduction (None: plain).

    A tensor-replicated parameter's slot holds this rank's share of the TP sum, so its gradient is
    ``Partial`` there: a later ``Partial`` micro-batch adds in place and a ``Replicate`` one is
    divided by TP on the way in, both by DTensor's own in-place rules. Sharded parameters keep
    their layout (DTensor slices or reduce-scatters what arrives).
    """
    if not isinstance(param, DTensor):
        return None
    if reduce_group_name(param) != "tp_dp_cp":
        return tuple(param.placements)
    return tuple(Partial() if isinstance(p, Replicate) else p for p in param.placements)


@dataclass
class _Bucket:
    """Parameters of one group and one dtype and their persistent flat buffer.

    ``buffer`` (allocated at first use, on the parameters' device) holds every parameter's
    gradient slot back to back, then one flag per parameter (how many ranks had a gradient).
    """

    params: list[nn.Parameter]
    group_name: str
    dtype: torch.dtype
    reduce_dtype: torch.dtype
    """The dtype the collective sums in: ``dtype``, or fp32 for narrower ones (module docstring)."""
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    """Gradient elements; the flags follow them in ``buffer``."""
    ready: set[int] = field(default_factory=set)
    buffer: Tensor | None = None
    """Gradient slots then flags; every ``param.grad`` of the bucket is a view into it."""
    slots: list[Tensor] = field(default_factory=list)
    """Each parameter's slot, a view of ``buffer`` in the parameter's local shape."""
    missing: list[int] = field(default_factory=list)
    """Parameters without a gradient on this rank at the last launch."""
    handle: object | None = None
    staging: Tensor | None = None
    """While an fp32 reduction of a narrower bucket is in flight: ``buffer`` in ``reduce_dtype``."""
    launched: bool = False
    """A collective summed this bucket since the last `GradSync.finish` (its flags are sums)."""

    def is_ready(self) -> bool:
        return len(self.ready) == len(self.params)

    def flags(self) -> Tensor:
        """The flag region of ``buffer``: one element per parameter."""
        return self.buffer[self.numel :]


class GradSync:
    """Bucketed, overlapped gradient reduction of one module over the groups of a `ParallelContext`.

    Args:
        module: the (parallelized) module, already cast to its final dtypes (one buffer per
            bucket dtype, fixed here); the buffers are allocated on the parameters' device at the
            first backward, and a parameter moved or cast after that raises there.
        ctx: the parallel context whose groups the gradients are summed over.
        bucket_size_mb: cap of one bucket's gradients, in MiB.
        overlap: launch buckets during backward (False: everything in :meth:`finish`).
        explicit_backward: the hooks act only between :meth:`begin_backward` and
            :meth:`end_backward` (default False: during every backward).
        grad_reduce_in_fp32: sum gradients of parameters narrower than fp32 (bf16, fp16) in fp32
            (default, Megatron's ``grad_reduce_in_fp32``); False: in the parameter dtype, with
            half the transient and more rounding (module docstring).
    """

    def __init__(
        self,
        module: nn.Module,
        ctx: ParallelContext,
        bucket_size_mb: float = 25.0,
        overlap: bool = True,
        *,
        explicit_backward: bool = False,
        grad_reduce_in_fp32: bool = True,
    ) -> None:
        self.ctx = ctx
        self.grad_reduce_in_fp32 = grad_reduce_in_fp32
        """Narrower gradients are summed in fp32."""
        self.scale = 1.0 / (ctx.size("dp") * ctx.size("cp"))
        self.overlap = overlap
        """Launch buckets during backward (False: everything in :meth:`finish`)."""
        self.explicit_backward = explicit_backward
        """Hooks act only between :meth:`begin_backward` and :meth:`end_backward`."""
        self._tp = ctx.size("tp")
        self._armed = not explicit_backward
        self._sync_enabled = True
        self._pending = False
        self._next_launch = 0
        self._staged: list[_Bucket] = []  # buckets whose fp32 copy is alive, oldest first
        self.buckets = self._make_buckets(module, int(bucket_size_mb * 2**20))
        self._bucket_of = {id(p): (i, j) for i, b in enumerate(self.buckets) for j, p in enumerate(b.params)}
        # Modules whose kernels can write a weight's gradient straight into its slot (GroupedExperts).
        self._placed: list[tuple[nn.Module, Tensor]] = []
        self._grad_writers = {
            id(p): m for m in module.modules() if callable(getattr(m, "place_weight_grad", None))
            for p in m.parameters(recurse=False)
        }
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
            for b in self.buckets
            for p in b.params
        ]

    def _make_buckets(self, module: nn.Module, cap_bytes: int) -> list[_Bucket]:
        # Reverse registration order approximates the order in which backward produces gradients.
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        replicated = {id(p) for p in tp_replicated_params(module)}
        buckets: list[_Bucket] = []
        open_buckets: dict[tuple[str, torch.dtype], _Bucket] = {}
        for p in params:
            key = (reduce_group_name(p, id(p) in replicated), _local(p).dtype)  # one group and dtype per buffer
            numel = _local(p).numel()
            bucket = open_buckets.get(key)
            if bucket is None or (bucket.numel + numel) * _local(p).element_size() > cap_bytes:
                bucket = _Bucket([], *key, reduce_dtype=self._reduce_dtype(key[1]))
                buckets.append(bucket)
                open_buckets[key] = bucket
            bucket.params.append(p)
            bucket.offsets.append(bucket.numel)
            bucket.numel += numel
        return buckets

    def _reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        narrower = dtype.is_floating_point and torch.finfo(dtype).bits < 32
        return torch.float32 if self.grad_reduce_in_fp32 and narrower else dtype

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

    def begin_backward(self) -> None:
        """Arm the hooks for the backward pass that follows (needed with ``explicit_backward=True``)."""
        self._armed = True

    def end_backward(self) -> None:
        """Disarm the hooks again (with ``explicit_backward=True``; otherwise they stay armed)."""
        self._armed = not self.explicit_backward

    # -- buffers --------------------------------------------------------------------------------

    def _allocate(self, bucket: _Bucket) -> None:
        first = _local(bucket.params[0])
        bucket.buffer = torch.zeros(bucket.numel + len(bucket.params), dtype=bucket.dtype, device=first.device)
        bucket.slots = [
            bucket.buffer[offset : offset + _local(p).numel()].view(_local(p).shape)
            for p, offset in zip(bucket.params, bucket.offsets)
        ]
        for p, slot in zip(bucket.params, bucket.slots):
            writer = self._grad_writers.get(id(p))
            if writer is not None and not isinstance(p, DTensor) and writer.place_weight_grad(p, slot):
                self._placed.append((writer, p))  # from the next step on: no copy, no second copy kept

    def _wrap(self, param: Tensor, slot: Tensor, placements: tuple | None) -> Tensor:
        """``slot`` as ``param``'s gradient: itself, or a DTensor with ``placements`` around it."""
        if placements is None:
            return slot
        return DTensor.from_local(slot, param.device_mesh, placements, run_check=False)

    def _adopt(self, bucket: _Bucket, j: int) -> None:
        """Make ``param.grad`` (not None) a view of its slot, holding this rank's contribution."""
        param, grad = bucket.params[j], bucket.params[j].grad
        if bucket.buffer is None:
            self._allocate(bucket)
        slot, local = bucket.slots[j], _local(grad)
        if local.data_ptr() == slot.data_ptr() and local.numel() == slot.numel():
            placements = _accumulating_placements(param)
            if placements is not None and tuple(grad.placements) != placements:
                # The reduced layout, kept by zero_grad(set_to_none=False): DTensor summed what
                # arrived since over TP on the in-place add; hold it as this rank's share again.
                if self._tp > 1:
                    slot.div_(self._tp)
                param.grad = self._wrap(param, slot, placements)
            return
        if local.device != slot.device or _local(param).dtype != bucket.dtype:
            raise RuntimeError(
                f"GradSync's buffer for a parameter of shape {tuple(param.shape)} is {bucket.dtype} on "
                f"{slot.device}, but the parameter is now {_local(param).dtype} with its gradient on "
                f"{local.device}: build GradSync after the model's final .to(device, dtype)."
            )
        _land_grad(param, slot, self._tp)
        param.grad = self._wrap(param, slot, _accumulating_placements(param))

    # -- reduction ------------------------------------------------------------------------------

    def _on_grad_ready(self, param: Tensor) -> None:
        if not self._armed:
            return  # a backward outside the training step: see the module docstring
        self._pending = True
        i, j = self._bucket_of[id(param)]
        with torch.no_grad():
            self._adopt(self.buckets[i], j)
        if not (self._sync_enabled and self.overlap):
            return
        self.buckets[i].ready.add(j)
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].is_ready():
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    @torch.no_grad()
    def _launch(self, bucket: _Bucket) -> None:
        bucket.missing = []
        for j, p in enumerate(bucket.params):
            if p.grad is None:
                bucket.missing.append(j)
            else:
                self._adopt(bucket, j)  # usually done by its hook already: then only a pointer check
        if bucket.buffer is None:
            self._allocate(bucket)
        for j in bucket.missing:
            bucket.slots[j].zero_()
        if self.ctx.size(bucket.group_name) == 1:
            if self.scale != 1.0:  # one product: rounded once in any dtype
                bucket.buffer[: bucket.numel].mul_(self.scale)
            return
        # Flags written on the device (no host list to copy): 1 where this rank had a gradient.
        flags = bucket.flags()
        flags.fill_(1)
        for j in bucket.missing:
            flags[j].fill_(0)
        reduced = bucket.buffer
        if bucket.reduce_dtype != bucket.dtype:
            while len(self._staged) >= FP32_BUCKETS_IN_FLIGHT:
                self._drain(self._staged[0])
            reduced = bucket.staging = bucket.buffer.to(bucket.reduce_dtype)
            self._staged.append(bucket)
        if self.scale != 1.0:
            reduced[: bucket.numel].mul_(self.scale)
        bucket.handle = dist.all_reduce(reduced, group=self.ctx.group(bucket.group_name), async_op=True)
        bucket.launched = True

    def _drain(self, bucket: _Bucket) -> None:
        """Wait for ``bucket``'s collective; an fp32 sum is rounded back into its slots and freed."""
        if bucket.handle is not None:
            bucket.handle.wait()
            bucket.handle = None
        if bucket.staging is not None:
            bucket.buffer.copy_(bucket.staging)
            bucket.staging = None
            self._staged.remove(bucket)

    def finish(self) -> None:
        """Launch the remaining buckets and wait for all of them; the gradients are then reduced.

        A no-op when no gradient arrived since the last call (every rank must agree on that: call
        it on all ranks after the same backward passes).
        """
        if not self._pending:
            return
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        for bucket in self.buckets:
            self._drain(bucket)
        # A parameter that had a gradient here has one after the sum; only the others' flags are
        # read, all buckets in one device-to-host copy (none at all in the usual case).
        unread = [b for b in self.buckets if b.missing and b.launched]
        counts = torch.cat([b.flags().float() for b in unread]).tolist() if unread else []
        had_somewhere: dict[int, set[int]] = {}
        for bucket in unread:
            had_somewhere[id(bucket)] = {j for j in bucket.missing if counts[j] > 0}
            counts = counts[len(bucket.params) :]
        for bucket in self.buckets:
            revived = had_somewhere.get(id(bucket), set())
            for j, p in enumerate(bucket.params):
                if j in revived or (isinstance(p.grad, DTensor) and p.grad.placements != p.placements):
                    # No gradient here but some elsewhere, or a DTensor held as Partial: the slot
                    # now holds the reduced gradient in the parameter's own layout.
                    p.grad = self._wrap(p, bucket.slots[j], tuple(p.placements) if isinstance(p, DTensor) else None)
            bucket.ready.clear()
            bucket.missing = []
            bucket.launched = False
        self._next_launch = 0
        self._pending = False

    def reduce_accumulated(self) -> None:
        """Nothing to start early: gradients accumulated under :meth:`no_sync` are all reduced by
        :meth:`finish` (the :class:`~lightning_moe.parallel.gradient_sync.GradientSync` interface)."""

    def remove_hooks(self) -> None:
        """Detach from the module's parameters (and let the expert kernels go of the bucket slots)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for writer, param in self._placed:
            writer.place_weight_grad(param, None)
        self._placed.clear()
