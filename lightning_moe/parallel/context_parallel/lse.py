"""Attention sinks and sliding windows through the log-sum-exp: the math the ring and one device share.

An attention sink (GPT-OSS) is one learned logit ``s_h`` per query head that joins every softmax
denominator of head ``h`` and is dropped after, as ``transformers``' ``eager_attention_forward`` of
``gpt_oss`` does (softmax over ``[scores, s_h]``, sink column removed): a key with logit ``s_h`` and
a zero value. From an attention output ``out`` and its per-row log-sum-exp ``lse`` over the real keys,
the sink gives ``lse' = logaddexp(lse, s)`` and ``out' = out * exp(lse - lse') = out * sigmoid(lse - s)``;
the flash-attention backward of the real keys, given ``out'`` and ``lse'``, is then exactly that of
the softmax with the sink, and ``d s = -sum over rows of exp(s - lse') * (dout . out')``
(:func:`add_sinks`, :func:`sinks_grad`). The context-parallel ring applies the sink once, to the
merged log-sum-exp of all its blocks.

A sliding window of ``W`` lets the query at position ``i`` see the keys ``j`` with
``i - W < j <= i``, as ``transformers``' ``sliding_window_causal_mask_function`` (:func:`window_visible`).

:func:`lse_attention` is attention with an optional window and sinks by the block kernels of
:mod:`lightning_moe.parallel.context_parallel.blocks`, with its own backward: the single-device
``CoreAttention`` uses it when sinks are set (a window in tiles of queries over the keys they reach),
and the all-gather exchange of context parallelism too.
No collective here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_moe.parallel.context_parallel.blocks import masked_kernel, select_block_kernel

__all__ = ["WINDOW_TILE", "add_sinks", "lse_attention", "sinks_grad", "window_visible"]


def window_visible(q_positions: Tensor, k_positions: Tensor, window: int | None) -> Tensor:
    """Bool ``[S_q, S_k]``: True where query ``i`` sees key ``j`` (``j <= i``, and ``i - window < j`` when set)."""
    q_pos, k_pos = q_positions[:, None], k_positions[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible = visible & (k_pos > q_pos - window)
    return visible


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """``(out', lse')`` of attention ``out`` ``[B, H, S, Dv]`` (fp32) with ``lse`` ``[B, H, S]`` once the
    per-head ``sinks`` ``[H]`` join the denominator (module docstring)."""
    sink = sinks.float().view(1, -1, 1)
    total = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - total).unsqueeze(-1), total


def sinks_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """``d sinks`` ``[H]`` (the sinks' dtype) from the output gradient and the ``out'``/``lse'`` of :func:`add_sinks`."""
    sink = sinks.float().view(1, -1, 1)
    delta = (dout.float() * out.float()).sum(-1)  # [B, H, S]
    return (-(torch.exp(sink - lse) * delta)).sum(dim=(0, 2)).to(sinks.dtype)


def _repeat(x: Tensor, repeat: int) -> Tensor:
    return x if repeat == 1 else x.repeat_interleave(repeat, dim=1)


def _sum_repeats(grad: Tensor, repeat: int) -> Tensor:
    return grad if repeat == 1 else grad.unflatten(1, (-1, repeat)).sum(2)


WINDOW_TILE = 256
"""Query rows per kernel call of a sliding window on one device (at least the window): each tile attends
only to the keys its window reaches, so a window costs ``O(S x (tile + W))``, not ``O(S^2)``."""


def _calls(q: Tensor, k: Tensor, window: int | None, q_positions: Tensor | None, k_positions: Tensor | None):
    """The kernel calls ``(query rows, key rows, causal, mask)`` of one attention (slices of the sequences).

    No positions and no window (or one covering the sequence): one causal call. No positions and a
    window: tiles of queries over the keys in their windows, masked. Positions (context parallelism's
    gathered keys): one call masked by them.
    """
    seq = q.shape[2]
    if q_positions is not None:
        return [(slice(0, seq), slice(0, k.shape[2]), False, window_visible(q_positions, k_positions, window))]
    if window is None or window >= seq:
        return [(slice(0, seq), slice(0, seq), True, None)]
    tile = max(window, WINDOW_TILE)
    calls = []
    for start in range(0, seq, tile):
        stop, first_key = min(start + tile, seq), max(0, start - window + 1)
        positions = torch.arange(first_key, stop, device=q.device)
        mask = window_visible(positions[start - first_key:], positions, window)
        calls.append((slice(start, stop), slice(first_key, stop), False, mask))
    return calls


class _LseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, scale, window, q_positions, k_positions, kernel_name):
        repeat = q.shape[1] // k.shape[1]
        kernel = select_block_kernel(q, v, kernel_name)
        out = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=torch.float32)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        saved = []
        with torch.autocast(q.device.type, enabled=False):
            k_all, v_all = _repeat(k, repeat), _repeat(v, repeat)
            for rows, keys, causal, mask in _calls(q, k, window, q_positions, k_positions):
                call_kernel = masked_kernel(kernel, mask)
                block_out, lse[:, :, rows], kernel_saved = call_kernel.forward(
                    q[:, :, rows], k_all[:, :, keys], v_all[:, :, keys], causal, scale, mask
                )
                out[:, :, rows] = block_out.float()
                saved.append((call_kernel, kernel_saved))
            if sinks is not None:
                out, lse = add_sinks(out, lse, sinks)
        result = out.to(q.dtype)
        # Masks are rebuilt in backward from the positions: O(S) saved, not O(S^2).
        ctx.save_for_backward(q, k, v, sinks, result, lse, q_positions, k_positions)
        ctx.scale, ctx.window, ctx.saved = scale, window, saved
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, sinks, out, lse, q_positions, k_positions = ctx.saved_tensors
        repeat = q.shape[1] // k.shape[1]
        grad = grad.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = q.new_zeros((*q.shape[:2], *k.shape[2:]), dtype=torch.float32)  # per query head, summed below
        dv = q.new_zeros((*q.shape[:2], *v.shape[2:]), dtype=torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            k_all, v_all = _repeat(k, repeat), _repeat(v, repeat)
            calls = _calls(q, k, ctx.window, q_positions, k_positions)
            for (rows, keys, causal, mask), (call_kernel, kernel_saved) in zip(calls, ctx.saved):
                block_dq, block_dk, block_dv = call_kernel.backward(
                    grad[:, :, rows], q[:, :, rows], k_all[:, :, keys], v_all[:, :, keys], out[:, :, rows],
                    lse[:, :, rows], kernel_saved, causal, ctx.scale, mask,
                )
                dq[:, :, rows] += block_dq.float()
                dk[:, :, keys] += block_dk.float()
                dv[:, :, keys] += block_dv.float()
            dsinks = sinks_grad(grad, out, lse, sinks) if sinks is not None else None
        dk, dv = _sum_repeats(dk, repeat), _sum_repeats(dv, repeat)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None, None


def lse_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, *, sinks: Tensor | None = None, window: int | None = None,
    q_positions: Tensor | None = None, k_positions: Tensor | None = None, kernel: str = "auto",
) -> Tensor:
    """Causal attention of ``q`` over ``k``/``v`` through a block kernel's log-sum-exp, with optional sinks.

    Args:
        q: ``[B, H, S_q, D]``; ``k`` ``[B, H_kv, S_k, D]``, ``v`` ``[B, H_kv, S_k, Dv]`` (``H`` a multiple
            of ``H_kv``: grouped-query heads are repeated for the kernel, their gradients summed back).
        scale: multiplies ``q @ k^T``.
        sinks: ``[H]`` logits joining each head's softmax denominator (module docstring); they get
            gradients.
        window: sliding window ``W``: query ``i`` sees keys ``i - W < j <= i`` (:func:`window_visible`).
        q_positions, k_positions: ``[S_q]`` / ``[S_k]`` positions of the queries and keys (context
            parallelism's gathered keys); None: ``0 .. S-1`` for both (``S_q == S_k``). Every query
            should see at least one key unless ``sinks`` are given (such a row's output is 0).
        kernel: ``"auto"``, ``"math"``, ``"cpu_flash"`` or ``"cuda_flash"``
            (:func:`~lightning_moe.parallel.context_parallel.blocks.select_block_kernel`; a masked block runs
            a kernel that takes masks).

    Returns ``[B, H, S_q, Dv]`` in ``q``'s dtype.
    """
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"attention needs the query heads ({q.shape[1]}) to be a multiple of the key/value heads "
            f"(keys {k.shape[1]}, values {v.shape[1]})."
        )
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(
            f"sinks must hold one logit per query head, shape [{q.shape[1]}], got {tuple(sinks.shape)}."
        )
    if (q_positions is None) != (k_positions is None):
        raise ValueError("lse_attention needs both q_positions and k_positions, or neither (positions 0 .. S-1).")
    if k.dtype != q.dtype or v.dtype != q.dtype:  # the fused kernels take one dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
    return _LseAttention.apply(q, k, v, sinks, scale, window, q_positions, k_positions, kernel)
