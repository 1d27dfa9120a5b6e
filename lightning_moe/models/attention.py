"""Causal self-attention of the reference model: RMSNorm, rotary embeddings, grouped-query attention.

Everything here is single-device code (docs/architecture.md §2). The attention module reads the number of
heads it holds from its projections' output width at run time (``view(B, S, -1, head_dim)``), so a
tensor-parallel plan that column-shards ``q_proj``/``k_proj``/``v_proj`` and row-shards ``o_proj``
needs no change here: each rank then simply computes its local heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Attention", "CoreAttention", "RMSNorm", "apply_rotary", "rotary_cos_sin"]


class RMSNorm(nn.Module):
    """Root-mean-square normalisation ``x / sqrt(mean(x**2) + eps) * weight`` over the last dim.

    Computed in fp32 and returned in the input dtype (as Megatron Core and Hugging Face do), so
    bf16 activations are normalised without precision loss. ``weight`` ``[dim]`` starts at ones.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Set the scale to ones."""
        self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        """Normalise ``x`` ``[..., dim]``; returns the same shape and dtype."""
        return F.rms_norm(x.float(), (self.dim,), self.weight.float(), self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """Rotary tables for positions ``0 .. seq_len-1``: ``(cos, sin)``, each fp32 ``[seq_len, head_dim]``.

    Frequency ``theta ** (-2j / head_dim)`` for pair ``j``, repeated for both halves of the head
    (the "rotate half" layout of Hugging Face Llama/Qwen/Mixtral/OLMoE and Megatron's default
    ``rotary_interleaved=False``). Computed on the fly: a few ``S x head_dim`` flops, no buffer to
    rebuild after a meta-device build.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # [S, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [S, head_dim]
    return angles.cos(), angles.sin()


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, S, heads, head_dim]`` by the position tables ``[S, head_dim]`` (fp32 math)."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # [S, 1, head_dim], broadcast over batch and heads
    x32 = x.float()
    return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)


class CoreAttention(nn.Module):
    """Causal ``scaled_dot_product_attention`` with GQA: ``q`` ``[B, heads, S, D]``, ``k``/``v``
    ``[B, kv_heads, S, D]`` -> ``[B, heads, S, D]``.

    No parameters; a module of its own so the attention kernel is a named boundary
    (``layers.{i}.attn.core_attn``) for recompute and activation offload (Megatron's ``core_attn``).
    """

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    """Causal multi-head / grouped-query self-attention with rotary embeddings and optional qk-norm.

    Projections (``nn.Linear``, no bias; weights ``[out, in]``): ``q_proj`` ``[heads*D, H]``,
    ``k_proj`` and ``v_proj`` ``[kv_heads*D, H]``, ``o_proj`` ``[H, heads*D]``; with qk-norm,
    ``q_norm`` and ``k_norm`` are :class:`RMSNorm` over one head (``[D]``), applied before the
    rotation as in Qwen3. Attention itself is ``core_attn`` (:class:`CoreAttention`,
    ``scaled_dot_product_attention(is_causal=True)``) with GQA (each kv head serves
    ``heads // kv_heads`` consecutive query heads).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        """Width D of one head; the head counts are read from the projections at run time."""
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.core_attn = CoreAttention()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Attend causally over ``x`` ``[B, S, H]`` with rotary tables ``[S, D]``; returns ``[B, S, H]``."""
        batch, seq, _ = x.shape
        # -1 = the heads this module holds: all of them on one device, a shard under tensor parallelism.
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)  # [B, S, heads, D]
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)  # [B, S, kv_heads, D]
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)  # [B, S, kv_heads, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads or kv_heads, S, D]
        out = self.core_attn(q, k, v)
        out = out.transpose(1, 2).reshape(batch, seq, -1)  # [B, S, heads*D]
        return self.o_proj(out)
