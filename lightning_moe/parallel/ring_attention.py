"""Ring attention over the CP group: K/V blocks travel the ring, each step runs a fused block kernel.

The ``"p2p"`` exchange of :func:`~lightning_moe.parallel.context_parallel.context_parallel_attention`.
CP rank ``r`` holds chunks ``r`` and ``2C-1-r`` of every sequence (Megatron's causal load balance).
At step ``i`` it holds the K/V of rank ``src = r - i (mod C)`` and attends with one of three
shapes, none of which needs a mask:

* ``i = 0``: its own chunks, causal (a square block, in position order);
* ``src < r``: all its queries over ``src``'s first chunk (entirely earlier; ``src``'s second chunk
  is entirely later than both of its chunks);
* ``src > r``: its second chunk's queries over both of ``src``'s chunks (its first chunk is
  earlier than all of ``src``'s keys and sees none of them).

Partial outputs are merged online in fp32 through their log-sum-exp. The backward recomputes each
block's gradients from the merged output and log-sum-exp (flash attention's backward), K/V travel
the ring again, and each block's K/V gradient accumulates as it follows its block around the ring
until it reaches its owner. The next hop is posted before the current block is computed, so on
NCCL the exchange overlaps the kernel. K/V travel with their own (grouped-query) head count, the
kernels see them repeated; gradients of K/V travel and accumulate in fp32.

The block kernels (:mod:`lightning_moe.parallel.attention_blocks`) are the device's fused ones
where they apply (CUDA flash attention in bf16/fp16, PyTorch's fused CPU kernels), else fp32
matmuls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_moe.parallel.attention_blocks import select_block_kernel

__all__ = ["ring_attention"]

_KV_TAG, _GRAD_TAG = 0, 1  # gloo matches sends and receives by tag: the two streams stay apart


class _Hop:
    """A posted exchange with the ring's neighbours: send ``x`` to the next rank, receive the previous rank's."""

    def __init__(self, x: Tensor, group, tag: int) -> None:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group)
        # Held until wait(): the caching allocator must not hand the buffers out while the transfer runs.
        self.sent, self.received = x, torch.empty_like(x)
        self.requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, x, ranks[(rank + 1) % size], group, tag),
            dist.P2POp(dist.irecv, self.received, ranks[(rank - 1) % size], group, tag),
        ])

    def wait(self) -> Tensor:
        for request in self.requests:
            request.wait()
        self.sent = None
        return self.received


def _pack(k: Tensor, v: Tensor) -> Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buffer: Tensor, k_shape, v_shape) -> tuple[Tensor, Tensor]:
    split = k_shape.numel()
    return buffer[:split].view(k_shape), buffer[split:].view(v_shape)


def _block(rank: int, step: int, size: int, seq_local: int):
    """(query rows, key rows, causal) of step ``step`` (module docstring), as slices of the local sequence."""
    half = seq_local // 2
    everything = slice(0, seq_local)
    if step == 0:
        return everything, everything, True
    source = (rank - step) % size
    if source < rank:
        return everything, slice(0, half), False
    return slice(half, seq_local), everything, False


def _ring_steps(k: Tensor, v: Tensor, group, q_heads: int):
    """Walk the ring: yield ``(step, query rows, key rows, causal, k block, v block)`` per step.

    The K/V blocks are repeated to ``q_heads`` heads for the kernel. The next hop is posted before
    the step is yielded and awaited when the caller asks for the next one, so the exchange runs
    while the caller computes.
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    repeat = q_heads // k.shape[1]
    buffer = _pack(k, v)
    for step in range(size):
        hop = _Hop(buffer, group, _KV_TAG) if step + 1 < size else None
        k_block, v_block = _unpack(buffer, k.shape, v.shape)
        rows, keys, causal = _block(rank, step, size, k.shape[2])
        yield step, rows, keys, causal, _repeat(k_block[:, :, keys], repeat), _repeat(v_block[:, :, keys], repeat)
        if hop is not None:
            buffer = hop.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group, scale: float, kernel_name: str) -> Tensor:
        batch, heads, seq_local, _ = q.shape
        kernel = select_block_kernel(q, v, kernel_name)
        out = q.new_zeros((batch, heads, seq_local, v.shape[-1]), dtype=torch.float32)
        lse = q.new_full((batch, heads, seq_local), float("-inf"), dtype=torch.float32)
        saved = []
        with torch.autocast(q.device.type, enabled=False):
            for _, rows, _, causal, k_block, v_block in _ring_steps(k, v, group, heads):
                block_out, block_lse, kernel_saved = kernel.forward(q[:, :, rows], k_block, v_block, causal, scale)
                saved.append(kernel_saved)
                merged = torch.logaddexp(lse[:, :, rows], block_lse)
                out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - merged).unsqueeze(-1)
                                   + block_out.float() * torch.exp(block_lse - merged).unsqueeze(-1))
                lse[:, :, rows] = merged
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.scale, ctx.kernel, ctx.kernel_saved = group, scale, kernel, saved
        return result

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, kernel = ctx.group, ctx.scale, ctx.kernel
        repeat = q.shape[1] // k.shape[1]
        grad = grad.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        grad_hop = None
        with torch.autocast(q.device.type, enabled=False):
            for step, rows, keys, causal, k_block, v_block in _ring_steps(k, v, group, q.shape[1]):
                block_dq, block_dk, block_dv = kernel.backward(
                    grad[:, :, rows], q[:, :, rows], k_block, v_block, out[:, :, rows], lse[:, :, rows],
                    ctx.kernel_saved[step], causal, scale,
                )
                dq[:, :, rows] += block_dq.float()
                block_grads = k.new_zeros(k.numel() + v.numel(), dtype=torch.float32)  # what travels on
                dk, dv = _unpack(block_grads, k.shape, v.shape)
                dk[:, :, keys] = _sum_repeats(block_dk.float(), repeat)
                dv[:, :, keys] = _sum_repeats(block_dv.float(), repeat)
                if grad_hop is not None:  # the gradient of this K/V block accumulated by the ranks before
                    block_grads += grad_hop.wait()
                # Follows the K/V block: after the last step it reaches the block's owner.
                grad_hop = _Hop(block_grads, group, _GRAD_TAG) if dist.get_world_size(group) > 1 else None
        own = grad_hop.wait() if grad_hop is not None else block_grads
        dk, dv = _unpack(own, k.shape, v.shape)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _repeat(x: Tensor, repeat: int) -> Tensor:
    return x if repeat == 1 else x.repeat_interleave(repeat, dim=1)


def _sum_repeats(grad: Tensor, repeat: int) -> Tensor:
    return grad if repeat == 1 else grad.unflatten(1, (-1, repeat)).sum(2)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group, scale: float, kernel: str = "auto") -> Tensor:
    """Causal attention of this CP rank's load-balanced chunks over the whole sequence (module docstring).

    Args:
        q: ``[B, H, S_local, D]``; ``k`` ``[B, H_kv, S_local, D]``; ``v`` ``[B, H_kv, S_local, Dv]``
            (``H`` a multiple of ``H_kv``; ``S_local`` even: two chunks).
        group: the CP process group.
        scale: multiplies ``q @ k^T``.
        kernel: the block kernel: ``"auto"`` (the device's fused kernel where it applies),
            ``"math"``, ``"cpu_flash"`` or ``"cuda_flash"``.

    Returns ``[B, H, S_local, Dv]`` in ``q``'s dtype.
    """
    if k.dtype != q.dtype or v.dtype != q.dtype:  # the fused kernels take one dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
    return _RingAttention.apply(q, k, v, group, scale, kernel)
