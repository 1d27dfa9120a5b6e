"""Context-parallel causal attention in pure PyTorch: each sequence sharded over the CP ranks.

Load balance for causal masks (Megatron's): a sequence of length ``S`` is cut into ``2C`` equal
chunks and CP rank ``r`` holds chunks ``r`` and ``2C - 1 - r`` (:func:`load_balanced_positions`,
:func:`shard_sequence`), so every rank gets the same amount of causal work. Attention of the
local queries over the whole sequence, by one of two exchanges of the keys and values
(``cp_comm_type``):

* ``"all_gather"``: every rank gathers all K/V chunks (backward: reduce-scatter of their
  gradients) and attends with the mask ``key position <= query position`` in one
  ``scaled_dot_product_attention`` call (the device's fused kernels, in the inputs' dtype);
* ``"p2p"``: a ring (:mod:`lightning_moe.parallel.context_parallel.ring`). K/V blocks travel ``C - 1``
  hops with ``batch_isend_irecv``, overlapped with the attention of the block at hand; each step's
  partial attention is merged online through its log-sum-exp (the flash-attention merge), so no
  rank holds more than two K/V blocks at a time. Each step runs the device's fused attention
  kernel (CUDA flash attention in bf16/fp16, PyTorch's fused CPU kernels; fp32 matmuls where
  neither applies) with no mask: the load balance makes every block either causal and square or
  wholly visible. The backward recomputes each block from the merged output and log-sum-exp and
  sends each K/V gradient along the ring to its owner.

GPT-OSS's sliding windows and attention sinks work with both exchanges: the all-gather masks the
window and adds the sinks through the kernels' log-sum-exp; the ring skips blocks wholly outside the
window and adds the sinks once to its merged log-sum-exp.

The collectives are this module's own autograd functions and make every incoming gradient
contiguous (``torch.distributed.nn.functional.all_gather`` gives wrong gradients on gloo for
non-contiguous ones).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_moe.parallel.context_parallel.lse import lse_attention, window_visible
from lightning_moe.parallel.context_parallel.ring import ring_attention

__all__ = [
    "CP_COMM_TYPES",
    "context_parallel_attention",
    "load_balanced_positions",
    "shard_sequence",
    "unshard_sequence",
]

CP_COMM_TYPES = ("p2p", "all_gather")


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


def context_parallel_attention(
    q: Tensor, k: Tensor, v: Tensor, group, cp_comm_type: str = "p2p", softmax_scale: float | None = None,
    block_kernel: str = "auto", sinks: Tensor | None = None, window: int | None = None,
) -> Tensor:
    """Causal attention of this CP rank's queries over the whole sequence.

    Args:
        q: ``[B, H, S_local, D]``, this rank's two chunks (see :func:`shard_sequence`).
        k: ``[B, H_kv, S_local, D]``; ``H`` must be a multiple of ``H_kv`` (grouped-query attention).
        v: ``[B, H_kv, S_local, Dv]``.
        group: the CP process group (ranks in the order of their chunks).
        cp_comm_type: ``"p2p"`` (ring) or ``"all_gather"``.
        softmax_scale: multiplies ``q @ k^T``; None is ``D ** -0.5``.
        block_kernel: the attention kernel of the ring's steps, and of the all-gather with sinks:
            ``"auto"`` (the device's fused kernel where it applies), ``"math"`` (fp32 matmuls),
            ``"cpu_flash"``, ``"cuda_flash"`` (:mod:`lightning_moe.parallel.context_parallel.blocks`).
        sinks: ``[H]`` attention sinks (GPT-OSS), one logit per query head in every softmax
            denominator (:mod:`lightning_moe.parallel.context_parallel.lse`).
        window: sliding window ``W``: query ``i`` sees keys ``i - W < j <= i`` (global positions).

    Returns ``[B, H, S_local, Dv]`` in ``q``'s dtype. K/V travel with their own head count ``H_kv``.
    """
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"Unknown cp_comm_type {cp_comm_type!r}; choose one of {list(CP_COMM_TYPES)}.")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"context-parallel attention needs the query heads ({q.shape[1]}) to be a multiple of the key/value "
            f"heads (keys {k.shape[1]}, values {v.shape[1]})."
        )
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if cp_comm_type == "p2p":
        return ring_attention(q, k, v, group, scale, block_kernel, sinks=sinks, window=window)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    positions = [load_balanced_positions(q.shape[2] * size, r, size, device=q.device) for r in range(size)]
    # Gather along a leading dim of its own, then lay the ranks' blocks side by side.
    k_cat = torch.cat(list(_AllGather.apply(k.unsqueeze(0), group).unbind(0)), dim=2)  # [B, H_kv, S, D]
    v_cat = torch.cat(list(_AllGather.apply(v.unsqueeze(0), group).unbind(0)), dim=2)
    if q.shape[1] != k.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k_cat, v_cat = k_cat.repeat_interleave(repeat, dim=1), v_cat.repeat_interleave(repeat, dim=1)
    # One attention over the whole sequence: the fused SDPA kernels (with a mask) where the device
    # has them. Every query sees at least itself, so no row is fully masked.
    if sinks is not None:  # through the kernel's log-sum-exp, which SDPA does not return
        return lse_attention(q, k_cat, v_cat, scale, sinks=sinks, window=window, q_positions=positions[rank],
                             k_positions=torch.cat(positions), kernel=block_kernel)
    visible = window_visible(positions[rank], torch.cat(positions), window)
    return F.scaled_dot_product_attention(q, k_cat, v_cat, attn_mask=visible, scale=scale)
