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
32-aligned columns), so a rank reads only its slices of the packed tensors; :func:`dequantized_dtype` is the dtype
``transformers`` gives them (the directory's ``config.json`` dtype).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["BLOCKS_SUFFIX", "FP4_VALUES", "SCALES_SUFFIX", "VALUES_PER_BLOCK", "dequantize_mxfp4", "dequantized_dtype",
           "mxfp4_pairs", "mxfp4_shape"]

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

    Any leading dimensions (``[E, R, G, 16]`` as stored: the expert one, or none), the last two
    of the result swapped as ``transformers`` swaps them. ``blocks`` may also be ``[..., R, G * 16]``
    (each block's bytes in the last dimension).
    """
    if scales.dim() < 2:
        raise ValueError(f"MXFP4 scales must be [..., R, G] (at least 2 dimensions), got {tuple(scales.shape)}.")
    blocks = _check(blocks, scales)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low = lut[(blocks & 0x0F).long()]
    high = lut[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # low nibble first: [..., R, G, 32]
    exponent = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values, exponent.unsqueeze(-1).to(torch.float32))
    values = values.flatten(-2)  # [..., R, G * 32]
    return values.transpose(-2, -1).contiguous().to(dtype)


def mxfp4_shape(blocks_shape: tuple[int, ...], scales_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape :func:`dequantize_mxfp4` gives for packed tensors of these shapes (nothing read):
    ``(..., G * 32, R)`` of scales ``(..., R, G)``."""
    scales_shape, blocks_shape = tuple(scales_shape), tuple(blocks_shape)
    half = VALUES_PER_BLOCK // 2
    # Blocks are scales + (16,), or scales with G * 16 last (each block's bytes in the last dimension).
    if len(scales_shape) < 2 or blocks_shape not in (
        (*scales_shape, half), (*scales_shape[:-1], scales_shape[-1] * half)
    ):
        raise ValueError(
            f"MXFP4 blocks {blocks_shape} do not match scales {scales_shape}: expected scales (..., R, G) and "
            f"blocks (..., R, G, {half}) or (..., R, G * {half})."
        )
    *leading, rows, groups = scales_shape
    return (*leading, groups * VALUES_PER_BLOCK, rows)


def dequantized_dtype(config: Mapping[str, Any]) -> torch.dtype:
    """The dtype ``transformers`` dequantises a directory's MXFP4 tensors to: that of the parameters
    they load into, ``config.json``'s ``dtype`` (or older ``torch_dtype``); fp32 where it names none.

    The stored expert biases are in this dtype too, so the loaded model keeps one dtype throughout.
    """
    name = config.get("dtype", config.get("torch_dtype"))
    if name is None:
        return torch.float32
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"config.json's dtype {name!r} is not a floating-point torch dtype; MXFP4 weights are dequantised "
            "to it: set it to e.g. 'bfloat16' or 'float32'."
        )
    return dtype


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
