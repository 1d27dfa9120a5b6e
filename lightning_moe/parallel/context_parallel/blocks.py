"""Attention of a block of queries over a block of keys, returning the log-sum-exp: the ring's kernel.

Ring attention (:mod:`lightning_moe.parallel.context_parallel.ring`) attends over one K/V block at a time
and merges the partial results through their per-row log-sum-exp (LSE); its backward recomputes
each block's gradients from the merged output and LSE, as flash attention does. Public SDPA does
not return the LSE, so each kernel here is a forward that returns ``(out, lse, saved)`` and a
backward that takes the merged ``out``/``lse`` and gives ``(dq, dk, dv)``:

* :class:`CudaFlashBlock`: PyTorch's CUDA flash-attention kernels (``aten._scaled_dot_product_flash
  _attention`` and its backward), bf16/fp16 on sm80+, head dims up to 256;
* :class:`CpuFlashBlock`: PyTorch's fused CPU kernels (``aten._scaled_dot_product_flash_attention
  _for_cpu`` and its backward), fp32/bf16/fp16;
* :class:`MathBlock`: fp32 matmuls and explicit gradients, for everything else (fp32 on CUDA,
  head dims the fused kernels refuse).

Without a sliding window every block of the load-balanced ring is either causal on a square block
(a rank's own chunks) or unmasked (the rank's queries over a key range wholly before them). A sliding
window adds blocks only partly inside it: those take ``mask`` (bool ``[S_q, S_k]``, True = visible),
which :class:`MathBlock` and :class:`CpuFlashBlock` support (``supports_mask``), and may hold rows
that see no key of the block: such a row gets output 0 and log-sum-exp ``-inf``, which the merge
weighs 0. The fused kernels want one head dim for q, k and v: a narrower ``v`` (MLA:
``qk_head_dim`` 192, ``v_head_dim`` 128) is zero-padded to the query's width and the extra output
columns dropped, which leaves the result unchanged. Inputs are ``[B, H, S, D]`` with equal head
counts (the ring repeats grouped-query K/V heads); LSE is ``[B, H, S_q]`` fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_moe import compat

__all__ = ["BLOCK_KERNELS", "CpuFlashBlock", "CudaFlashBlock", "MathBlock", "masked_kernel", "select_block_kernel"]


class MathBlock:
    """Block attention by fp32 matmuls; gradients by the flash-attention backward formulas."""

    name = "math"
    supports_mask = True

    @staticmethod
    def _scores(q: Tensor, k: Tensor, causal: bool, scale: float, mask: Tensor | None = None) -> Tensor:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        if causal:  # square block: query i sees keys 0..i (the diagonal keeps every row finite)
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores

    @classmethod
    def forward(cls, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Tensor | None = None):
        """``(out fp32, lse fp32, None)``; a row that sees no key gets output 0 and ``lse`` ``-inf``."""
        scores = cls._scores(q, k, causal, scale, mask)
        lse = torch.logsumexp(scores, dim=-1)
        # exp(-inf - 0) = 0 for a row with no visible key (exp(-inf - -inf) would be NaN).
        finite = lse.masked_fill(torch.isinf(lse), 0.0)
        return torch.matmul(torch.exp(scores - finite.unsqueeze(-1)), v.float()), lse, None

    @classmethod
    def backward(cls, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, saved,
                 causal: bool, scale: float, mask: Tensor | None = None):
        """``(dq, dk, dv)`` in fp32 of this block, given the merged ``out`` and ``lse`` of its rows."""
        probs = torch.exp(cls._scores(q, k, causal, scale, mask) - lse.unsqueeze(-1))
        dout = dout.float()
        dv = torch.matmul(probs.transpose(-1, -2), dout)
        delta = (dout * out.float()).sum(-1, keepdim=True)
        dscores = probs * (torch.matmul(dout, v.float().transpose(-1, -2)) - delta)
        dq = torch.matmul(dscores, k.float()) * scale
        dk = torch.matmul(dscores.transpose(-1, -2), q.float()) * scale
        return dq, dk, dv


def _pad_last(x: Tensor, width: int) -> Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _additive_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The fused CPU kernel's mask: 0 where visible, ``-inf`` elsewhere, in the inputs' dtype (it takes no bool)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


class CpuFlashBlock:
    """PyTorch's fused CPU attention kernels (``_scaled_dot_product_flash_attention_for_cpu``)."""

    name = "cpu_flash"
    supports_mask = True

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Tensor | None = None):
        """``(out, lse fp32, None)``; ``out`` in the inputs' dtype, ``v``'s width."""
        out, lse = compat.flash_attention_cpu(
            q.contiguous(), k.contiguous(), _pad_last(v, q.shape[-1]).contiguous(), 0.0, causal,
            attn_mask=_additive_mask(mask, q.dtype), scale=scale,
        )
        if mask is not None:  # the kernel gives a row with no visible key output 0 but lse 0: make it -inf
            lse = lse.masked_fill(~mask.any(-1), float("-inf"))
        return out[..., : v.shape[-1]], lse, None

    @staticmethod
    def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, saved,
                 causal: bool, scale: float, mask: Tensor | None = None):
        """``(dq, dk, dv)`` of this block (the inputs' dtype), given the merged ``out`` and ``lse``."""
        width = q.shape[-1]
        dq, dk, dv = compat.flash_attention_cpu_backward(
            _pad_last(dout.to(q.dtype), width).contiguous(), q.contiguous(), k.contiguous(),
            _pad_last(v, width).contiguous(), _pad_last(out.to(q.dtype), width).contiguous(), lse.contiguous(),
            0.0, causal, attn_mask=_additive_mask(mask, q.dtype), scale=scale,
        )
        return dq, dk, dv[..., : v.shape[-1]]


class CudaFlashBlock:
    """PyTorch's CUDA flash-attention kernels (``_scaled_dot_product_flash_attention``)."""

    name = "cuda_flash"
    supports_mask = False  # the public flash op takes no mask: masked blocks fall back to MathBlock

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
        """``(out, lse fp32, saved)``: ``saved`` are the kernel's sequence and RNG outputs its backward takes."""
        out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = compat.flash_attention_cuda(
            q, k, _pad_last(v, q.shape[-1]), 0.0, causal, False, scale=scale
        )
        return out[..., : v.shape[-1]], lse[..., : q.shape[2]], (cum_q, cum_k, max_q, max_k, rng_state, unused)

    @staticmethod
    def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, saved,
                 causal: bool, scale: float):
        """``(dq, dk, dv)`` of this block (the inputs' dtype), given the merged ``out`` and ``lse``."""
        width = q.shape[-1]
        cum_q, cum_k, max_q, max_k, rng_state, unused = saved
        dq, dk, dv = compat.flash_attention_cuda_backward(
            _pad_last(dout.to(q.dtype), width).contiguous(), q, k, _pad_last(v, width),
            _pad_last(out.to(q.dtype), width).contiguous(), lse.contiguous(), cum_q, cum_k, max_q, max_k,
            0.0, causal, rng_state, unused, scale=scale,
        )
        return dq, dk, dv[..., : v.shape[-1]]


BLOCK_KERNELS = {kernel.name: kernel for kernel in (MathBlock, CpuFlashBlock, CudaFlashBlock)}
"""Block kernels by name: ``"math"``, ``"cpu_flash"``, ``"cuda_flash"``."""


def _cuda_flash_fits(q: Tensor, v: Tensor) -> bool:
    width = q.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and torch.backends.cuda.flash_sdp_enabled()
        and torch.cuda.get_device_capability(q.device)[0] >= 8
        and width <= 256 and width % 8 == 0 and v.shape[-1] <= width
    )


def select_block_kernel(q: Tensor, v: Tensor, kernel: str = "auto"):
    """The block kernel for ``q``/``v``: ``"auto"`` takes the device's fused one where it applies, else ``"math"``.

    A block that needs a mask runs a kernel with ``supports_mask`` (:func:`masked_kernel`)."""
    if kernel != "auto":
        if kernel not in BLOCK_KERNELS:
            raise ValueError(f"Unknown attention block kernel {kernel!r}; choose 'auto' or one of {list(BLOCK_KERNELS)}.")
        return BLOCK_KERNELS[kernel]
    if q.device.type == "cuda" and _cuda_flash_fits(q, v):
        return CudaFlashBlock
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16) and v.shape[-1] <= q.shape[-1]:
        return CpuFlashBlock
    return MathBlock


def masked_kernel(kernel, mask: Tensor | None):
    """``kernel``, or :class:`MathBlock` when ``mask`` is given and ``kernel`` takes none."""
    return kernel if mask is None or kernel.supports_mask else MathBlock
