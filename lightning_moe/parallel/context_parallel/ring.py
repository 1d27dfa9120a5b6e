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

A sliding window ``W`` (GPT-OSS's sliding layers; query ``i`` sees keys ``i - W < j <= i``) is planned
per pair of chunks from their positions: a pair wholly outside the window costs no kernel call (a
step all of whose pairs are outside computes nothing, though its K/V still pass on), a pair partly
inside gets a mask (the block kernels' ``mask``; on CUDA such blocks run the fp32 matmul kernel). Rows
that see no key of a block merge with weight 0. Attention sinks (GPT-OSS) join the merged
log-sum-exp once, after the last step (:mod:`lightning_moe.parallel.context_parallel.lse`); the backward
then runs on the output and log-sum-exp with the sinks, and each rank's queries give the sinks their
share of the gradient.

Partial outputs are merged online in fp32 through their log-sum-exp. The backward recomputes each
block's gradients from the merged output and log-sum-exp (flash attention's backward), K/V travel
the ring again, and each block's K/V gradient accumulates as it follows its block around the ring
until it reaches its owner. The next hop is posted before the current block is computed, so on
NCCL the exchange overlaps the kernel. K/V travel with their own (grouped-query) head count, the
kernels see them repeated; gradients of K/V travel and accumulate in fp32.

The block kernels (:mod:`lightning_moe.parallel.context_parallel.blocks`) are the device's fused ones
where they apply (CUDA flash attention in bf16/fp16, PyTorch's fused CPU kernels), else fp32
matmuls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_moe.parallel.context_parallel.blocks import masked_kernel, select_block_kernel
from lightning_moe.parallel.context_parallel.lse import add_sinks, sinks_grad, window_visible

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


class _Call:
    """One kernel call of a ring step: query rows and key rows (slices of the local sequence), causal, mask."""

    __slots__ = ("causal", "keys", "mask", "rows")

    def __init__(self, rows: slice, keys: slice, causal: bool, mask: Tensor | None) -> None:
        self.rows, self.keys, self.causal, self.mask = rows, keys, causal, mask


_NONE, _FULL, _DIAGONAL, _PARTIAL = range(4)  # how much of a key chunk a query chunk sees


def _pair(query_chunk: int, key_chunk: int, chunk: int, window: int | None) -> int:
    """What query chunk ``query_chunk`` sees of key chunk ``key_chunk`` (global chunk indices, ``chunk`` tokens each)."""
    if key_chunk > query_chunk:
        return _NONE
    if key_chunk == query_chunk:  # causal; the window cuts it when shorter than the chunk
        return _DIAGONAL if window is None or window >= chunk else _PARTIAL
    if window is None:
        return _FULL
    gap = (query_chunk - key_chunk) * chunk  # query position minus key position of the chunks' first tokens
    if gap - chunk + 1 >= window:  # even the closest pair (last key, first query) is out of the window
        return _NONE
    return _FULL if gap + chunk - 1 < window else _PARTIAL


def _positions(chunks: tuple[int, int], chunk: int, device) -> Tensor:
    """Global positions of a rank's two chunks (``context_parallel.load_balanced_positions``)."""
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunks])


def _chunk_rows(indices: list[int], chunk: int) -> slice:
    return slice(indices[0] * chunk, (indices[-1] + 1) * chunk)  # indices are [0], [1] or [0, 1]


def _step_calls(rank: int, source: int, size: int, seq_local: int, window: int | None, device) -> list[_Call]:
    """The kernel calls of this rank's queries over ``source``'s keys; none for blocks wholly outside the window.

    Chunk pairs are classified by their positions (:func:`_pair`) in Python, so planning costs no
    device work. Without a window this gives the module docstring's three shapes, one call each.
    With one, a chunk pair no query of which sees a key is skipped; the pairs left go to one call
    when they fill a rectangle (the causal square at step 0 may leave its upper-right pair, hidden
    by causality), else one call per pair; a call with a partly covered pair gets a mask.
    """
    chunk = seq_local // 2
    mine, theirs = (rank, 2 * size - 1 - rank), (source, 2 * size - 1 - source)
    kinds = {(a, b): _pair(mine[a], theirs[b], chunk, window) for a in (0, 1) for b in (0, 1)}
    needed = [pair for pair, kind in kinds.items() if kind != _NONE]
    if not needed:
        return []
    rows = sorted({a for a, _ in needed})
    keys = sorted({b for _, b in needed})
    rectangle = [(a, b) for a in rows for b in keys]
    square = source == rank and rows == keys == [0, 1]
    # At step 0 the upper-right pair (first chunk's queries, last chunk's keys) is hidden by causality.
    if all(kinds[p] != _NONE or (square and p == (0, 1)) for p in rectangle):
        groups = [(rows, keys)]
    else:
        groups = [([a], [b]) for a, b in needed]
    calls = []
    for group_rows, group_keys in groups:
        pairs = [kinds[(a, b)] for a in group_rows for b in group_keys]
        row_slice, key_slice = _chunk_rows(group_rows, chunk), _chunk_rows(group_keys, chunk)
        same_positions = source == rank and group_rows == group_keys
        if _PARTIAL not in pairs and _DIAGONAL not in pairs:
            calls.append(_Call(row_slice, key_slice, False, None))
        elif _PARTIAL not in pairs and same_positions:
            calls.append(_Call(row_slice, key_slice, True, None))
        else:
            q_pos = _positions(mine, chunk, device)[row_slice]
            k_pos = _positions(theirs, chunk, device)[key_slice]
            calls.append(_Call(row_slice, key_slice, False, window_visible(q_pos, k_pos, window)))
    return calls


def _ring_steps(k: Tensor, v: Tensor, group, window: int | None):
    """Walk the ring: yield ``(step, calls, k block, v block)`` per step (:func:`_step_calls`).

    The K/V blocks are the step's source's whole local sequence, with their own head count (each
    call slices and repeats what it needs). The next hop is posted before the step is yielded and
    awaited when the caller asks for the next one, so the exchange runs while the caller computes.
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    buffer = _pack(k, v)
    for step in range(size):
        hop = _Hop(buffer, group, _KV_TAG) if step + 1 < size else None
        calls = _step_calls(rank, (rank - step) % size, size, k.shape[2], window, k.device)
        yield (step, calls, *_unpack(buffer, k.shape, v.shape))
        if hop is not None:
            buffer = hop.wait()


def _keys(block: Tensor, call: _Call, repeat: int) -> Tensor:
    """The rows of a K/V block a call attends to, repeated to the query heads for the kernel."""
    return _repeat(block[:, :, call.keys], repeat)


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """The online log-sum-exp merge; rows that have seen no key yet on either side stay (0, -inf)."""
    merged = torch.logaddexp(lse, block_lse)
    finite = merged.masked_fill(torch.isinf(merged), 0.0)  # exp(-inf - -inf) would be NaN
    block_out = block_out.float().masked_fill(torch.isinf(block_lse).unsqueeze(-1), 0.0)
    merged_out = (out * torch.exp(lse - finite).unsqueeze(-1)
                  + block_out * torch.exp(block_lse - finite).unsqueeze(-1))
    return merged_out, merged


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks, group, scale: float, kernel_name: str, window):
        batch, heads, seq_local, _ = q.shape
        repeat = heads // k.shape[1]
        kernel = select_block_kernel(q, v, kernel_name)
        out = q.new_zeros((batch, heads, seq_local, v.shape[-1]), dtype=torch.float32)
        lse = q.new_full((batch, heads, seq_local), float("-inf"), dtype=torch.float32)
        saved = []
        with torch.autocast(q.device.type, enabled=False):
            for _, calls, k_block, v_block in _ring_steps(k, v, group, window):
                step_saved = []
                for call in calls:
                    call_kernel = masked_kernel(kernel, call.mask)
                    rows = call.rows
                    block_out, block_lse, kernel_saved = call_kernel.forward(
                        q[:, :, rows], _keys(k_block, call, repeat), _keys(v_block, call, repeat), call.causal, scale,
                        call.mask,
                    )
                    step_saved.append((call_kernel, kernel_saved))
                    out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
                saved.append(step_saved)
            if sinks is not None:  # once, on the merged log-sum-exp of every block
                out, lse = add_sinks(out, lse, sinks)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, result, lse)
        ctx.group, ctx.scale, ctx.window, ctx.kernel_saved = group, scale, window, saved
        return result

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        repeat = q.shape[1] // k.shape[1]
        grad = grad.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        grad_hop = None
        with torch.autocast(q.device.type, enabled=False):
            dsinks = sinks_grad(grad, out, lse, sinks) if sinks is not None else None
            for step, calls, k_block, v_block in _ring_steps(k, v, group, ctx.window):
                block_grads = k.new_zeros(k.numel() + v.numel(), dtype=torch.float32)  # what travels on
                dk, dv = _unpack(block_grads, k.shape, v.shape)
                for call, (call_kernel, kernel_saved) in zip(calls, ctx.kernel_saved[step]):
                    rows, keys = call.rows, call.keys
                    block_dq, block_dk, block_dv = call_kernel.backward(
                        grad[:, :, rows], q[:, :, rows], _keys(k_block, call, repeat), _keys(v_block, call, repeat),
                        out[:, :, rows], lse[:, :, rows], kernel_saved, call.causal, scale, call.mask,
                    )
                    dq[:, :, rows] += block_dq.float()
                    dk[:, :, keys] += _sum_repeats(block_dk.float(), repeat)
                    dv[:, :, keys] += _sum_repeats(block_dv.float(), repeat)
                if grad_hop is not None:  # the gradient of this K/V block accumulated by the ranks before
                    block_grads += grad_hop.wait()
                # Follows the K/V block: after the last step it reaches the block's owner.
                grad_hop = _Hop(block_grads, group, _GRAD_TAG) if dist.get_world_size(group) > 1 else None
        own = grad_hop.wait() if grad_hop is not None else block_grads
        dk, dv = _unpack(own, k.shape, v.shape)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None


def _repeat(x: Tensor, repeat: int) -> Tensor:
    return x if repeat == 1 else x.repeat_interleave(repeat, dim=1)


def _sum_repeats(grad: Tensor, repeat: int) -> Tensor:
    return grad if repeat == 1 else grad.unflatten(1, (-1, repeat)).sum(2)


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group, scale: float, kernel: str = "auto", sinks: Tensor | None = None,
    window: int | None = None,
) -> Tensor:
    """Causal attention of this CP rank's load-balanced chunks over the whole sequence (module docstring).

    Args:
        q: ``[B, H, S_local, D]``; ``k`` ``[B, H_kv, S_local, D]``; ``v`` ``[B, H_kv, S_local, Dv]``
            (``H`` a multiple of ``H_kv``; ``S_local`` even: two chunks).
        group: the CP process group.
        scale: multiplies ``q @ k^T``.
        kernel: the block kernel: ``"auto"`` (the device's fused kernel where it applies),
            ``"math"``, ``"cpu_flash"`` or ``"cuda_flash"``.
        sinks: ``[H]`` attention sinks (GPT-OSS), applied once to the merged log-sum-exp; they get
            this rank's share of their gradient.
        window: sliding window ``W`` (query ``i`` sees keys ``i - W < j <= i``); blocks wholly outside
            it are skipped, partly covered ones masked.

    Returns ``[B, H, S_local, Dv]`` in ``q``'s dtype.
    """
    if k.dtype != q.dtype or v.dtype != q.dtype:  # the fused kernels take one dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
    return _RingAttention.apply(q, k, v, sinks, group, scale, kernel, window)
