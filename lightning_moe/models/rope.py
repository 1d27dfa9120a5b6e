"""Rotary position embeddings: the tables, their YaRN context extension, and the rotation itself.

Tables are computed on the fly (a few ``S x D`` flops, no buffer to rebuild after a meta-device
build). Two layouts of the rotated pairs, both as in Hugging Face and Megatron Core:

* "rotate half" (the default; HF Llama/Qwen/Mixtral/OLMoE, Megatron ``rotary_interleaved=False``):
  feature ``j`` pairs with ``j + D/2``;
* interleaved (DeepSeek-V3's ``rope_interleave``, Megatron ``rotary_interleaved=True``): feature
  ``2j`` pairs with ``2j + 1``. :func:`apply_rotary` de-interleaves the features first and
  returns them in the rotate-half layout, as ``transformers`` does: queries and keys are rotated
  alike, so their dot products are those of the interleaved rotation.

YaRN (:class:`RopeScaling`, arXiv:2309.00071) follows ``transformers``'
``_compute_yarn_parameters``: interpolated and extrapolated frequencies blended by a linear ramp
between the correction dimensions of ``beta_fast`` / ``beta_slow``, and cos/sin multiplied by
the attention factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_moe.layers.field_docs import document_fields

__all__ = ["ROPE_SCALING_TYPES", "RopeScaling", "apply_rotary", "rotary_cos_sin", "yarn_mscale"]

ROPE_SCALING_TYPES = ("yarn",)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@document_fields
@dataclass
class RopeScaling:
    """YaRN context extension of the rotary embedding (Hugging Face ``rope_parameters`` of type
    ``yarn``; Megatron ``rope_type: yarn`` with ``rotary_scaling_factor``)."""

    factor: float
    """Context extension factor (HF ``factor``, Megatron ``rotary_scaling_factor``): positions up
    to ``factor * original_max_seq_len`` are interpolated into the trained range. Must be >= 1."""

    original_max_seq_len: int
    """Context length the model was pretrained with (HF ``original_max_position_embeddings``)."""

    type: str = "yarn"
    """Scaling method; only ``yarn`` is implemented."""

    beta_fast: float = 32.0
    """Rotations above which a frequency is kept (extrapolated) (HF ``beta_fast``)."""

    beta_slow: float = 1.0
    """Rotations below which a frequency is fully interpolated (HF ``beta_slow``)."""

    mscale: float | None = None
    """Numerator of the attention factor when ``mscale_all_dim`` is set too (HF ``mscale``)."""

    mscale_all_dim: float | None = None
    """Denominator of the attention factor, and (multi-head latent attention only) the softmax
    scale correction ``yarn_mscale(factor, mscale_all_dim) ** 2`` (HF ``mscale_all_dim``)."""

    attention_factor: float | None = None
    """Multiplier of the cos/sin tables; None derives it from ``factor`` and the mscales as
    ``transformers`` does (HF ``attention_factor``)."""

    truncate: bool = True
    """Round the correction range outwards to whole dimensions (HF ``truncate``)."""

    def __post_init__(self) -> None:
        if self.type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"Unknown rope scaling type {self.type!r}; choose one of {list(ROPE_SCALING_TYPES)}."
            )
        if not self.factor >= 1:
            raise ValueError(f"RopeScaling.factor must be >= 1 (a context extension), got {self.factor}.")
        if self.original_max_seq_len < 1:
            raise ValueError(f"RopeScaling.original_max_seq_len must be >= 1, got {self.original_max_seq_len}.")
        if not self.beta_fast > 0 or not self.beta_slow > 0:
            raise ValueError(
                f"RopeScaling needs beta_fast > 0 and beta_slow > 0, got {self.beta_fast} and {self.beta_slow}."
            )

    def cos_sin_factor(self) -> float:
        """The attention factor the cos/sin tables are multiplied by."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def inv_freq(self, dim: int, theta: float, device: torch.device | str | None = None) -> Tensor:
        """fp32 ``[dim / 2]`` inverse frequencies of YaRN for a rotary width ``dim`` and base ``theta``."""

        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp, as upstream
        pos_freqs = theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp  # weight of the unscaled frequency
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rotary_cos_sin(
    seq_len: int,
    head_dim: int,
    theta: float,
    device: torch.device | str | None = None,
    scaling: RopeScaling | None = None,
    positions: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Rotary tables for positions ``0 .. seq_len-1``: ``(cos, sin)``, each fp32 ``[seq_len, head_dim]``.

    Frequency ``theta ** (-2j / head_dim)`` for pair ``j`` (YaRN's blend with ``scaling``),
    repeated for both halves of the head; with ``scaling`` both tables are multiplied by its
    attention factor. ``positions`` (``[seq_len]`` integers) gives the tokens' positions instead,
    e.g. a context-parallel rank's chunks of a longer sequence.
    """
    if scaling is None:
        exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
        inv_freq = 1.0 / (theta**exponents)
    else:
        inv_freq = scaling.inv_freq(head_dim, theta, device)
    if positions is None:
        positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions.to(device=inv_freq.device, dtype=torch.float32), inv_freq)  # [S, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [S, head_dim]
    cos, sin = angles.cos(), angles.sin()
    if scaling is not None and (factor := scaling.cos_sin_factor()) != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos, sin


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Rotate ``x`` ``[B, S, heads, D]`` by the position tables ``[S, R]`` (fp32 math).

    ``R <= D``: tables narrower than the head (partial rotary, GLM-4.5's ``partial_rotary_factor``)
    rotate the first ``R`` features, pairing ``j`` with ``j + R/2`` within them, and pass the other
    ``D - R`` through unchanged, as ``transformers`` does. ``interleaved`` pairs features
    ``(2j, 2j+1)``; the result is in the rotate-half layout then (see the module docstring).
    """
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary], cos, sin, interleaved)
        return torch.cat([rotated, x[..., rotary:]], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [S, 1, R], broadcast over batch and heads
    x32 = x.float()
    if interleaved:
        x32 = torch.cat([x32[..., 0::2], x32[..., 1::2]], dim=-1)
    return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)
