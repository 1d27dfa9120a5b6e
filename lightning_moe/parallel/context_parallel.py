"""Context-parallel causal attention in pure PyTorch: each sequence sharded over the CP ranks.

Load balance for causal masks (Megatron's): a sequence of length ``S`` is cut into ``2C`` equal
chunks and CP rank ``r`` holds chunks ``r`` and ``2C - 1 - r`` (:func:`load_balanced_positions`,
:func:`shard_sequence`), so every rank gets the same amount of causal work. Attention of the
local queries over the whole sequence, by one of two exchanges of the keys and values
(``cp_comm_type``):

* ``"all_gather"``: every rank gathers all K/V chunks (backward: reduce-scatter of their
  gradients) and attends with the mask ``key position <= query position`` in one
  ``scaled_dot_product_attention`` call (the device's fused kernels, in the inputs' dtype);
* ``"p2p"``: a ring. K/V blocks travel ``C - 1`` hops with ``batch_isend_irecv``; each step's
  partial attention and its log-sum-exp are merged online (the flash-attention merge), so no rank
  holds more than two K/V blocks at a time. The backward runs the ring in reverse through the
  same differentiable hop. Scores, softmax and merge are computed in fp32 by matmuls (fused
  kernels do not return the differentiable log-sum-exp the merge needs).

Masks are finite (``-1e30`` instead of ``-inf``) so that rows with no visible key in one block (a
query chunk before a whole key block) merge to exact zeros instead of NaN. The collectives are
this module's own autograd functions and make every incoming gradient contiguous
(``torch.distributed.nn.functional.all_gather`` gives wrong gradients on gloo for non-contiguous
ones).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "CP_COMM_TYPES",
    "MASK_VALUE",
    "context_parallel_attention",
    "load_balanced_positions",
    "shard_sequence",
    "unshard_sequence",
]

CP_COMM_TYPES = ("p2p", "all_gather")
MASK_VALUE = -1e30
"""Score of a masked (future) key: finite, so a fully masked block gives weights 0, not NaN."""


def load_balanced_positions(seq_len: int, cp_rank: int, cp_size: int, device=None) -> Tensor:
    """Global positions held by CP rank ``cp_rank``: chunk ``cp_rank`` then chunk ``2 * cp_size - 1 - cp_rank``."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"context parallelism cuts each sequence into 2 x CP = {2 * cp_size} equal chunks, but the sequence "
            f"length {seq_len} is not divisible by {2 * cp_size}; pad or crop sequences to a multiple of it."
        )
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last_index = 2 * cp_size - 1 - cp_rank
    second = torch.arange(last_index * chunk, (last_index + 1) * chunk, device=device)
    return torch.cat([first, second])


def shard_sequence(x: Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> Tensor:
    """This CP rank's two chunks of ``x`` along ``dim`` (a copy; see :func:`load_balanced_positions`)."""
    if cp_size == 1 and x.shape[dim] % 2 == 0:
        return x
    positions = load_balanced_positions(x.shape[dim], cp_rank, cp_size, device=x.device)
    return x.index_select(dim, positions)


def unshard_sequence(pieces: list[Tensor], dim: int = 1) -> Tensor:
    """The full sequence from every CP rank's :func:`shard_sequence` output, in rank order."""
    cp_size = len(pieces)
    chunks: list[Tensor | None] = [None] * (2 * cp_size)
    for rank, piece in enumerate(pieces):
        first, second = piece.chunk(2, dim=dim)
        chunks[rank], chunks[2 * cp_size - 1 - rank] = first, second
    return torch.cat(chunks, dim=dim)


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward reduce-scatters the (contiguous) gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


class _RingHop(torch.autograd.Function):
    """Send ``x`` to the next rank of the ring and return the previous rank's; backward goes the other way."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return _exchange(x.contiguous(), group, step=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _exchange(grad.contiguous(), ctx.group, step=-1), None


def _exchange(x: Tensor, group, step: int) -> Tensor:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group)
    out = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x, ranks[(rank + step) % size], group),
        dist.P2POp(dist.irecv, out, ranks[(rank - step) % size], group),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return out


def _partial_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float):
    """Causal attention of ``q`` over one K/V block: (output, log-sum-exp per query row)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    visible = k_pos[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible, MASK_VALUE)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.matmul(torch.exp(scores - lse), v.float())
    return out, lse


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Online-softmax merge of two partial attentions over disjoint key sets."""
    new_lse = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new_lse) + block_out * torch.exp(block_lse - new_lse), new_lse


def context_parallel_attention(
    q: Tensor, k: Tensor, v: Tensor, group, cp_comm_type: str = "p2p", softmax_scale: float | None = None,
) -> Tensor:
    """Causal attention of this CP rank's queries over the whole sequence.

    Args:
        q: ``[B, H, S_local, D]``, this rank's two chunks (see :func:`shard_sequence`).
        k: ``[B, H_kv, S_local, D]``; ``H`` must be a multiple of ``H_kv`` (grouped-query attention).
        v: ``[B, H_kv, S_local, Dv]``.
        group: the CP process group (ranks in the order of their chunks).
        cp_comm_type: ``"p2p"`` (ring) or ``"all_gather"``.
        softmax_scale: multiplies ``q @ k^T``; None is ``D ** -0.5``.

    Returns ``[B, H, S_local, Dv]`` in ``q``'s dtype (``p2p`` computes in fp32, ``all_gather`` in SDPA).
    """
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"Unknown cp_comm_type {cp_comm_type!r}; choose one of {list(CP_COMM_TYPES)}.")
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    seq_local = q.shape[2]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if q.shape[1] != k.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    positions = [load_balanced_positions(seq_local * size, r, size, device=q.device) for r in range(size)]
    q_pos = positions[rank]
    if cp_comm_type == "all_gather":
        # Gather along a leading dim of its own, then lay the ranks' blocks side by side.
        k_all = _AllGather.apply(k.unsqueeze(0), group)  # [C, B, H, S_local, D]
        v_all = _AllGather.apply(v.unsqueeze(0), group)
        k_cat = torch.cat(list(k_all.unbind(0)), dim=2)
        v_cat = torch.cat(list(v_all.unbind(0)), dim=2)
        # One attention over the whole sequence: the fused SDPA kernels (with a mask) where the device
        # has them. Every query sees at least itself, so no row is fully masked.
        visible = torch.cat(positions)[None, :] <= q_pos[:, None]
        return F.scaled_dot_product_attention(q, k_cat, v_cat, attn_mask=visible, scale=scale)
    out, lse = _partial_attention(q, k, v, q_pos, q_pos, scale)
    kv = torch.stack([k, v]) if k.shape[-1] == v.shape[-1] else None
    k_block, v_block = k, v
    for hop in range(1, size):
        if kv is not None:
            kv = _RingHop.apply(kv, group)
            k_block, v_block = kv.unbind(0)
        else:
            k_block, v_block = _RingHop.apply(k_block, group), _RingHop.apply(v_block, group)
        source = (rank - hop) % size
        block_out, block_lse = _partial_attention(q, k_block, v_block, q_pos, positions[source], scale)
        out, lse = _merge(out, lse, block_out, block_lse)
    return out.to(q.dtype)
