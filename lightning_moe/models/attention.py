"""Causal self-attention of the reference model: RMSNorm, grouped-query attention, qk-norm.

Everything here is single-device code (docs/architecture.md §2). The attention module reads the number of
heads it holds from its projections' output width at run time (``view(B, S, -1, head_dim)``), so a
tensor-parallel plan that column-shards ``q_proj``/``k_proj``/``v_proj`` and row-shards ``o_proj``
needs no change here: each rank then simply computes its local heads (except with ``qk_norm="full"``,
whose norm spans every head). Rotary embeddings live in :mod:`lightning_moe.models.rope` (re-exported
here); multi-head latent attention in :mod:`lightning_moe.models.mla`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_moe.models.rope import apply_rotary, rotary_cos_sin

__all__ = [
    "QK_NORM_MODES", "Attention", "CoreAttention", "RMSNorm", "apply_rotary", "qk_norm_mode", "rotary_cos_sin",
]

QK_NORM_MODES = ("head", "full")


def qk_norm_mode(qk_norm: bool | str | None) -> str | None:
    """The query/key norm ``qk_norm`` asks for: None (off), ``"head"`` (True) or ``"full"``."""
    if qk_norm is None or qk_norm is False:
        return None
    if qk_norm is True:
        return "head"
    if qk_norm in QK_NORM_MODES:
        return qk_norm
    raise ValueError(
        f"Unknown qk_norm {qk_norm!r}; use False, True or 'head' (one RMSNorm per head, Qwen3), or "
        "'full' (one RMSNorm over the whole projection, OLMoE)."
    )


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


class CoreAttention(nn.Module):
    """Causal ``scaled_dot_product_attention`` with GQA: ``q``/``k`` ``[B, heads or kv_heads, S, D]``,
    ``v`` ``[B, kv_heads, S, Dv]`` -> ``[B, heads, S, Dv]``; optionally a sliding window and sinks.

    No parameters; a module of its own so the attention kernel is a named boundary
    (``layers.{i}.attn.core_attn``) for recompute and activation offload (Megatron's ``core_attn``).
    ``softmax_scale`` multiplies ``q @ k^T``; None is ``D ** -0.5``. ``sliding_window`` ``W`` lets the
    query at position ``i`` see only the keys ``j`` with ``i - W < j <= i`` (``transformers``' sliding
    window); ``forward``'s ``sinks`` ``[heads]`` are GPT-OSS's attention sinks, one logit per head in
    every softmax denominator (:mod:`lightning_moe.parallel.context_parallel.lse`), the owner's parameter.
    Without sinks a window is an explicit mask to ``scaled_dot_product_attention``; with sinks the
    attention runs through a kernel's log-sum-exp (:func:`~lightning_moe.parallel.context_parallel.lse.lse_attention`).
    """

    def __init__(self, softmax_scale: float | None = None, sliding_window: int | None = None) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (or None for full attention), got {sliding_window}.")
        self.softmax_scale = softmax_scale
        self.sliding_window = sliding_window

    def forward(self, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None = None) -> Tensor:
        seq = q.shape[2]
        # A window at least as long as the sequence masks nothing causal attention does not.
        window = self.sliding_window if self.sliding_window is not None and self.sliding_window < seq else None
        if sinks is None and window is None:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1]
            )
        # At call time: the parallel package is only needed by models that use windows or sinks.
        from lightning_moe.parallel.context_parallel.lse import lse_attention, window_visible

        if sinks is None:
            positions = torch.arange(seq, device=q.device)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=window_visible(positions, positions, window), scale=self.softmax_scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )
        scale = self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5
        return lse_attention(q, k, v, scale, sinks=sinks, window=window)

    def extra_repr(self) -> str:
        parts = [] if self.softmax_scale is None else [f"softmax_scale={self.softmax_scale:.6g}"]
        if self.sliding_window is not None:
            parts.append(f"sliding_window={self.sliding_window}")
        return ", ".join(parts)


class Attention(nn.Module):
    """Causal multi-head / grouped-query self-attention with rotary embeddings and optional qk-norm.

    Projections (``nn.Linear``; weights ``[out, in]``): ``q_proj`` ``[heads*D, H]``,
    ``k_proj`` and ``v_proj`` ``[kv_heads*D, H]``, ``o_proj`` ``[H, heads*D]``; with
    ``attention_bias`` q/k/v have biases (Qwen2-MoE, GLM-4.5, GPT-OSS), with ``out_bias`` ``o_proj``
    has a bias ``[H]`` (GPT-OSS). ``qk_norm`` (see
    :func:`qk_norm_mode`): ``"head"`` (or True) makes ``q_norm`` and ``k_norm`` :class:`RMSNorm` s
    over one head (``[D]``), as in Qwen3; ``"full"`` makes them span the whole projection
    (``[heads*D]`` and ``[kv_heads*D]``), as in OLMoE. Either is applied before the rotation.
    Attention itself is ``core_attn`` (:class:`CoreAttention`,
    ``scaled_dot_product_attention(is_causal=True)``) with GQA (each kv head serves
    ``heads // kv_heads`` consecutive query heads). ``rope_interleaved`` selects DeepSeek's
    pairing of rotary features (see :mod:`lightning_moe.models.rope`); rotary tables narrower
    than ``head_dim`` rotate only the first features of each head (partial rotary). GPT-OSS:
    ``sinks`` adds the parameter ``sinks`` ``[heads]`` (one logit per query head in every softmax
    denominator, zeros here; the model draws them), ``sliding_window`` restricts each query to the
    last ``W`` keys (:class:`CoreAttention`).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: bool | str = False,
        norm_eps: float = 1e-6,
        rope_interleaved: bool = False,
        attention_bias: bool = False,
        out_bias: bool = False,
        sinks: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        """Width D of one head; the head counts are read from the projections at run time."""
        self.qk_norm = qk_norm_mode(qk_norm)
        """None, ``"head"`` or ``"full"``: which query/key norm is applied."""
        self.rope_interleaved = rope_interleaved
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=attention_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=attention_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=attention_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=out_bias)
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        """GPT-OSS's attention sinks ``[heads]`` (None without): a tensor-parallel plan shards them with the heads."""
        full = self.qk_norm == "full"
        self.q_norm = RMSNorm(num_heads * head_dim if full else head_dim, norm_eps) if self.qk_norm else None
        self.k_norm = RMSNorm(num_kv_heads * head_dim if full else head_dim, norm_eps) if self.qk_norm else None
        self.core_attn = CoreAttention(sliding_window=sliding_window)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Attend causally over ``x`` ``[B, S, H]`` with rotary tables ``[S, R]`` (``R <= D``); returns ``[B, S, H]``."""
        batch, seq, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":  # over every head at once, before the heads are split
            q, k = self.q_norm(q), self.k_norm(k)
        # -1 = the heads this module holds: all of them on one device, a shard under tensor parallelism.
        q = q.view(batch, seq, -1, self.head_dim)  # [B, S, heads, D]
        k = k.view(batch, seq, -1, self.head_dim)  # [B, S, kv_heads, D]
        v = v.view(batch, seq, -1, self.head_dim)  # [B, S, kv_heads, D]
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, cos, sin, self.rope_interleaved)
        k = apply_rotary(k, cos, sin, self.rope_interleaved)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads or kv_heads, S, D]
        # Sinks only when set: a core attention without them (a user's, or one swapped in) takes three tensors.
        out = self.core_attn(q, k, v) if self.sinks is None else self.core_attn(q, k, v, self.sinks)
        out = out.transpose(1, 2).reshape(batch, seq, -1)  # [B, S, heads*D]
        return self.o_proj(out)
