"""Multi-head latent attention (MLA) of DeepSeek-V2/V3, single-device code (docs/architecture.md §2).

Queries and keys/values go through low-rank latents (arXiv:2405.04434 §2.1)::

    c_q      = q_latent_norm(q_down_proj(x))                 [B, S, q_lora_rank]   (or no latent:
    q        = q_up_proj(c_q) -> heads x [q_nope ; q_rot]                          q = q_proj(x))
    [c_kv ; k_rot] = kv_down_proj(x)                         [B, S, kv_lora_rank + rope_dim]
    kv       = kv_up_proj(kv_latent_norm(c_kv)) -> heads x [k_nope ; v]
    k        = [k_nope ; rope(k_rot)]   (one rotary key shared by every head)
    out      = o_proj(softmax(q k^T * softmax_scale) v)

Rotary embeddings act on ``q_rot`` and the shared ``k_rot`` only (interleaved pairs by default in
DeepSeek-V3). With YaRN the softmax scale is ``qk_head_dim ** -0.5 * yarn_mscale(factor,
mscale_all_dim) ** 2``, as DeepSeek's reference and ``transformers`` compute it.

Tensor parallelism (``lightning_moe.parallel.tensor_parallel``, Megatron's MLA plan): the down
projections and latent norms are replicated (their gradients summed over TP), the up projections
column-parallel over heads and ``o_proj`` row-parallel; like :class:`Attention`, this module reads
the heads it holds from the up projections' output widths. ``rope_key`` is a parameter-free
boundary where the shared rotary key leaves the replicated part, so the plan can hand the per-head
computation a local tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_moe.models.attention import CoreAttention, RMSNorm
from lightning_moe.models.rope import RopeScaling, apply_rotary, yarn_mscale

__all__ = ["LATENT_NORM_EPS", "MultiLatentAttention", "RopeKey"]

LATENT_NORM_EPS = 1e-6
"""Epsilon of the two latent RMSNorms: fixed, as in DeepSeek's code and ``transformers``
(``DeepseekV3RMSNorm``'s default), whatever ``rms_norm_eps`` the rest of the model uses."""


class RopeKey(nn.Module):
    """Identity on the shared rotary key ``[B, S, rope_dim]``: a named boundary for parallel plans."""

    def forward(self, k_rot: Tensor) -> Tensor:
        return k_rot


class MultiLatentAttention(nn.Module):
    """Causal multi-head latent attention (see the module docstring).

    Parameters (``nn.Linear`` weights ``[out, in]``, no biases), with ``Dqk = nope + rope``:
    ``q_down_proj`` ``[q_lora_rank, H]``, ``q_latent_norm`` ``[q_lora_rank]``, ``q_up_proj``
    ``[heads*Dqk, q_lora_rank]`` (or ``q_proj`` ``[heads*Dqk, H]`` when ``q_lora_rank`` is None),
    ``kv_down_proj`` ``[kv_lora_rank + rope, H]`` (latent rows first, then the rotary key),
    ``kv_latent_norm`` ``[kv_lora_rank]``, ``kv_up_proj`` ``[heads*(nope + v_head_dim), kv_lora_rank]``
    (per head: nope key rows, then value rows), ``o_proj`` ``[H, heads*v_head_dim]``.
    ``forward(x [B, S, H], cos, sin [S, rope]) -> [B, S, H]``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        softmax_scale: float | None = None,
        rope_interleaved: bool = True,
    ) -> None:
        super().__init__()
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.rope_interleaved = rope_interleaved
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk_head_dim, bias=False)
        else:
            self.q_down_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
            self.q_latent_norm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_up_proj = nn.Linear(q_lora_rank, num_heads * qk_head_dim, bias=False)
        self.kv_down_proj = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_latent_norm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_up_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)
        self.rope_key = RopeKey()
        scale = softmax_scale if softmax_scale is not None else self.default_softmax_scale(qk_head_dim, None)
        self.core_attn = CoreAttention(scale)

    @staticmethod
    def default_softmax_scale(qk_head_dim: int, rope_scaling: RopeScaling | None) -> float:
        """``qk_head_dim ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
        scale = qk_head_dim**-0.5
        if rope_scaling is not None and rope_scaling.mscale_all_dim:
            scale *= yarn_mscale(rope_scaling.factor, rope_scaling.mscale_all_dim) ** 2
        return scale

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Attend causally over ``x`` ``[B, S, H]`` with rotary tables ``[S, rope]``; returns ``[B, S, H]``."""
        batch, seq, _ = x.shape
        nope, rope = self.qk_nope_head_dim, self.qk_rope_head_dim
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_up_proj(self.q_latent_norm(self.q_down_proj(x)))
        # -1 = the heads this module holds: all of them on one device, a shard under tensor parallelism.
        q = q.view(batch, seq, -1, nope + rope)  # [B, S, heads, Dqk]
        q_nope, q_rot = q.split([nope, rope], dim=-1)
        c_kv, k_rot = self.kv_down_proj(x).split([self.kv_lora_rank, rope], dim=-1)
        kv = self.kv_up_proj(self.kv_latent_norm(c_kv)).view(batch, seq, -1, nope + self.v_head_dim)
        k_nope, v = kv.split([nope, self.v_head_dim], dim=-1)  # [B, S, heads, nope], [B, S, heads, Dv]
        k_rot = self.rope_key(k_rot).unsqueeze(2)  # [B, S, 1, rope], shared by every head
        q_rot = apply_rotary(q_rot, cos, sin, self.rope_interleaved)
        k_rot = apply_rotary(k_rot, cos, sin, self.rope_interleaved)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
        out = self.core_attn(q, k, v)
        out = out.transpose(1, 2).reshape(batch, seq, -1)  # [B, S, heads*Dv]
        return self.o_proj(out)

    def extra_repr(self) -> str:
        return (
            f"kv_lora_rank={self.kv_lora_rank}, qk_nope_head_dim={self.qk_nope_head_dim}, "
            f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, "
            f"rope_interleaved={self.rope_interleaved}"
        )
