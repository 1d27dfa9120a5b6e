"""A reference MXFP4 quantiser, written from the OCP MX format GPT-OSS's checkpoints use.

Per 32 consecutive values of a row one power-of-two scale ``2 ** (floor(log2(amax)) - 2)`` (e2m1's
largest exponent is 2), each value divided by it and rounded to the nearest e2m1 value (clamped to
+-6), two 4-bit codes per byte with the low nibble first, the scale stored as its exponent + 127.
"""

from __future__ import annotations

import torch

__all__ = ["quantize_mxfp4"]

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` ``[E, C, R]`` (a projection as transformers holds it) -> (blocks ``[E, R, C/32, 16]``,
    scales ``[E, R, C/32]``, the values the pair stands for ``[E, C, R]``)."""
    rows = weight.transpose(1, 2)  # [E, R, C]: quantised along C
    e, r, c = rows.shape
    groups = rows.reshape(e, r, c // 32, 32)
    amax = groups.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax))
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    magnitude = scaled.abs().clamp(max=6.0)
    code = (magnitude.unsqueeze(-1) - E2M1).abs().argmin(-1)  # nearest e2m1 magnitude (ties: the smaller)
    negative = scaled < 0
    code = code + 8 * negative.long()
    values = torch.where(negative, -E2M1[code % 8], E2M1[code % 8]) * torch.exp2(exponent).unsqueeze(-1)
    codes = code.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent + 127).to(torch.uint8)
    return blocks, scales, values.reshape(e, r, c).transpose(1, 2)
