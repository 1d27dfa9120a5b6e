"""MXFP4 expert weights of Hugging Face checkpoints (GPT-OSS), dequantised on load.

The published GPT-OSS checkpoints store each expert projection ``name`` as two tensors:

* ``name_blocks``, uint8 ``[E, R, G, 16]``: per row ``r`` of the projection, ``G`` blocks of 32 FP4
  (e2m1) values, two per byte, the low nibble first;
* ``name_scales``, uint8 ``[E, R, G]``: one power-of-two scale per block, an e8m0 exponent biased
  by 127 (``2 ** (s - 127)``).

Dequantised, a projection is ``[E, R, G * 32]`` with its last two dimensions swapped, ``[E, G * 32, R]``:
``transformers``' ``convert_moe_packed_tensors`` (``integrations/mxfp4.py``), whose layout this
module reproduces value for value: ``gate_up_proj`` ``[E, H, 2F]`` from blocks ``[E, 2F, H / 32, 16]``,
``down_proj`` ``[E, F, H]`` from blocks ``[E, H, F / 32, 16]``. Every e2m1 value times a power of two
is exact in fp32 (and in bf16, which has fp32's exponent range), so dequantising in fp32 and casting
gives ``transformers``' numbers in any dtype.

:func:`dequantize_mxfp4` converts whole tensors or any block of them (a rank's experts, rows and
32-aligned columns), so a rank reads only its slices of the packed tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BLOCKS_SUFFIX", "FP4_VALUES", "SCALES_SUFFIX", "VALUES_PER_BLOCK", "dequantize_mxfp4", "mxfp4_pairs",
           "mxfp4_shape"]

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
VALUES_PER_BLOCK = 32
"""FP4 values sharing one scale (16 bytes of a block)."""
SCALE_BIAS = 127
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The e2m1 value of each 4-bit code (bit 3 the sign)."""


def _check(blocks: Tensor, scales: Tensor) -> Tensor:
    if blocks.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks must be uint8 (two FP4 values per byte), got {blocks.dtype}.")
    if blocks.dim() == scales.dim():  # the bytes of each block flattened into the last dimension
        blocks = blocks.reshape(*scales.shape, -1)
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != VALUES_PER_BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}: expected blocks of "
            f"shape scales.shape + ({VALUES_PER_BLOCK // 2},)."
        )
    return blocks


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The dequantised projection ``[..., G * 32, R]`` of ``blocks`` ``[..., R, G, 16]`` and ``scales``
    ``[..., R, G]``, in ``dtype`` (``transformers``' ``convert_moe_packed_tensors``, computed exactly in
    fp32 and then cast).

    ``blocks`` may also be ``[..., R, G * 16]`` (each block's bytes in the last dimension). At least
    3 dimensions (the expert one first), as ``transformers`` swaps dimensions 1 and 2.
    """
    blocks = _check(blocks, scales)
    if blocks.dim() < 4:
        raise ValueError(f"MXFP4 blocks need an expert dimension: [E, R, G, 16], got {tuple(blocks.shape)}.")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low = lut[(blocks & 0x0F).long()]
    high = lut[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # low nibble first: [..., R, G, 32]
    exponent = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values, exponent.unsqueeze(-1).to(torch.float32))
    values = values.flatten(-2)  # [..., R, G * 32]
    return values.transpose(1, 2).contiguous().to(dtype)


def mxfp4_shape(blocks_shape: tuple[int, ...], scales_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape :func:`dequantize_mxfp4` gives for packed tensors of these shapes (nothing read)."""
    experts, rows, *rest = scales_shape
    groups = rest[-1] if rest else 0
    if len(scales_shape) != 3 or tuple(blocks_shape[: len(scales_shape)]) != tuple(scales_shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks_shape)} do not match scales {tuple(scales_shape)}.")
    return (experts, groups * VALUES_PER_BLOCK, rows)


def mxfp4_pairs(names: set[str] | list[str]) -> dict[str, tuple[str, str]]:
    """``{name: (name_blocks, name_scales)}`` for every packed pair among the checkpoint's ``names``."""
    names = set(names)
    pairs = {}
    for name in names:
        if name.endswith(BLOCKS_SUFFIX):
            base = name[: -len(BLOCKS_SUFFIX)]
            if base + SCALES_SUFFIX in names:
                pairs[base] = (name, base + SCALES_SUFFIX)
    return pairs
