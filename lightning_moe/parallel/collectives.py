"""Differentiable collectives with uneven sizes, as the token dispatchers need them.

Each forward collective has its adjoint as backward:

* ``all_to_all`` with splits ``(out, in)`` -> backward is the all-to-all with the splits swapped;
* ``all_gather_v`` (rank ``r`` contributes ``sizes[r]`` rows) -> backward ``reduce_scatter_v``;
* ``reduce_scatter_v`` (every rank holds all ``sum(sizes)`` rows, rank ``r`` keeps the sum of its
  ``sizes[r]`` rows) -> backward ``all_gather_v``.

Equal sizes use the dedicated flat all-gather / reduce-scatter. An uneven all-gather is one batch of
point-to-point sends and receives: each rank sends its own rows (the same tensor) to every peer and
receives each peer's rows straight into its slice of the output, so nothing but the output is
allocated (an ``all_to_all_single`` would need the rows copied once per peer, and padding to the
largest count a ``world x largest`` buffer; NCCL runs its all-to-all as the same grouped sends and
receives). An uneven reduce-scatter runs in ``world - 1`` rounds on a ring: in round ``s`` each
rank sends its copy of rank ``r + s``'s rows and receives rank ``r - s``'s copy of its own into one
buffer, added to the output before the next round, so it allocates the output and that buffer
(twice the rows it keeps); receiving every peer's copy at once, as one all-to-all, holds
``world x`` the kept rows. The sum then rounds once per round, as NCCL's ring reduce-scatter of
equal sizes does; small ETP groups keep the extra rounds' latency low. Sizes are host lists: the caller has already paid the one device-to-host read a dropless dispatch
needs, and nothing here reads the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_v", "all_to_all", "gather_sizes", "reduce_scatter_v", "sum_grad"]

# torch 2.13 renamed the flat collectives (the old names warn); older releases only have the old.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _global_ranks(group, world: int) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(world))


def _all_to_all(x: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def _all_gather_v(x: Tensor, sizes: list[int], group) -> Tensor:
    world, rank = _world(group)
    if world == 1:
        return x
    if len(set(sizes)) == 1:
        out = x.new_empty((sum(sizes), *x.shape[1:]))
        _all_gather_flat(out, x.contiguous(), group=group)
        return out
    # Peers' rows land directly in their slices (contiguous views along dim 0); ours is copied.
    out = x.new_empty((sum(sizes), *x.shape[1:]))
    parts = out.split(sizes)
    x = x.contiguous()
    parts[rank].copy_(x)
    ops = []
    global_ranks = _global_ranks(group, world)
    for peer in range(world):
        if peer == rank:
            continue
        peer_global = global_ranks[peer]
        if x.shape[0]:
            ops.append(dist.P2POp(dist.isend, x, peer_global, group=group))
        if sizes[peer]:
            ops.append(dist.P2POp(dist.irecv, parts[peer], peer_global, group=group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out


def _reduce_scatter_v(x: Tensor, sizes: list[int], group) -> Tensor:
    world, rank = _world(group)
    if world == 1:
        return x
    if len(set(sizes)) == 1:
        out = x.new_empty((sizes[rank], *x.shape[1:]))
        _reduce_scatter_flat(out, x.contiguous(), group=group)
        return out
    # A ring (module docstring): round s sends rank r+s its rows and adds rank r-s's copy of ours.
    parts = x.contiguous().split(sizes)
    out = parts[rank].clone()
    received = torch.empty_like(out)
    global_ranks = _global_ranks(group, world)
    for shift in range(1, world):
        to, source = (rank + shift) % world, (rank - shift) % world
        ops = []
        if sizes[to]:
            ops.append(dist.P2POp(dist.isend, parts[to], global_ranks[to], group=group))
        if sizes[rank]:
            ops.append(dist.P2POp(dist.irecv, received, global_ranks[source], group=group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if sizes[rank]:
            out.add_(received)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


class _AllGatherV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _all_gather_v(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_v(grad, ctx.sizes, ctx.group), None, None


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_v(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_v(grad, ctx.sizes, ctx.group), None, None


class _SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad(x: Tensor, group) -> Tensor:
    """``x`` itself, whose gradient is summed over ``group`` in backward (Megatron's "copy to region").

    For a tensor every rank of ``group`` holds whole while each computes a part of its gradient
    (an expert adapter factor that expert-tensor parallelism does not cut): applied where the
    tensor is used, the reduction is part of the autograd graph, so it survives parameter
    replacement (meta-device materialisation) and acts on the tensor the forward used (FSDP2's
    unsharded parameter). ``group`` None or of one rank: ``x`` unchanged.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _SumGrad.apply(x, group)


def all_to_all(x: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
    """Differentiable ``all_to_all_single`` over dim 0: send ``input_splits[r]`` rows to rank r,
    receive ``output_splits[r]`` rows from rank r."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


def all_gather_v(x: Tensor, sizes: list[int], group) -> Tensor:
    """Differentiable concatenation over ranks of each rank's ``sizes[r]`` rows (rank order)."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllGatherV.apply(x, list(sizes), group)


def reduce_scatter_v(x: Tensor, sizes: list[int], group) -> Tensor:
    """Differentiable sum over ranks of ``x`` (``sum(sizes)`` rows), rank r keeping its ``sizes[r]`` rows."""
    if dist.get_world_size(group) == 1:
        return x
    return _ReduceScatterV.apply(x, list(sizes), group)


def gather_sizes(local: Tensor, group) -> Tensor:
    """All-gather a small integer tensor from every rank: ``[world, *local.shape]`` on the device."""
    world, _ = _world(group)
    if world == 1:
        return local.unsqueeze(0)
    # Gathered flat (gloo wants the output to be world x the input's shape along dim 0).
    out = local.new_empty(world * local.numel())
    _all_gather_flat(out, local.reshape(-1).contiguous(), group=group)
    return out.view(world, *local.shape)
