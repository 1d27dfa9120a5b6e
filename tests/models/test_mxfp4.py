"""MXFP4 dequantisation (``lightning_moe.models.hf.mxfp4``) against the reference quantiser of
``helpers.mxfp4`` and against ``transformers``' own ``convert_moe_packed_tensors``."""

from __future__ import annotations

import pytest
import torch
from helpers.mxfp4 import quantize_mxfp4

from lightning_moe.models.hf.mxfp4 import dequantize_mxfp4, dequantized_dtype, mxfp4_pairs, mxfp4_shape


def _weight(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-6, 4, shape, generator=gen).float())
    weight[0, :32, 0] = 0.0  # an all-zero block
    return weight


def test_dequantize_matches_the_reference_quantiser():
    weight = _weight((3, 64, 10))  # [E, H, 2F]: gate_up_proj's layout
    blocks, scales, expected = quantize_mxfp4(weight)
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == mxfp4_shape(tuple(blocks.shape), tuple(scales.shape)) == (3, 64, 10)
    assert torch.equal(got, expected)
    # The quantiser is a real one: the values are close to the weight, not equal to it.
    assert not torch.equal(got, weight)
    assert ((got - weight).abs() <= weight.abs().amax() / 4).all()
    # Bytes of each block flattened into the last dimension: the same numbers.
    assert torch.equal(dequantize_mxfp4(blocks.flatten(-2), scales), expected)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16), expected.to(torch.bfloat16))


def test_every_code_and_nibble_order():
    # One block per row holding every code once in its low and once in its high nibble.
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = (codes | (codes.flip(0) << 4)).reshape(1, 1, 1, 16)
    scales = torch.tensor([[[127 + 1]]], dtype=torch.uint8)  # 2 ** 1
    got = dequantize_mxfp4(blocks, scales)[0, :, 0]
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    expected = torch.stack([table, table.flip(0)], dim=-1).flatten() * 2
    assert torch.equal(got, expected)


def test_a_block_of_the_packed_tensors_dequantises_to_the_same_block():
    blocks, scales, expected = quantize_mxfp4(_weight((4, 96, 6), seed=1))
    part = dequantize_mxfp4(blocks[1:3, 2:5, 1:3], scales[1:3, 2:5, 1:3])
    assert torch.equal(part, expected[1:3, 32:96, 2:5])


def test_mismatched_shapes_are_refused():
    blocks, scales, _ = quantize_mxfp4(_weight((2, 64, 4)))
    with pytest.raises(ValueError, match="do not match scales"):
        dequantize_mxfp4(blocks[:, :, :1], scales)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.to(torch.int32), scales)


def test_shapes_of_too_few_dimensions_are_refused_with_the_expected_shapes():
    for blocks_shape, scales_shape in (((2, 3, 4, 16), (2,)), ((16,), ())):
        with pytest.raises(ValueError, match=r"do not match scales .*expected scales \(\.\.\., R, G\)"):
            mxfp4_shape(blocks_shape, scales_shape)
    with pytest.raises(ValueError, match=r"do not match scales"):
        mxfp4_shape((2, 3, 4, 8), (2, 3, 4))
    with pytest.raises(ValueError, match=r"at least 2 dimensions"):
        dequantize_mxfp4(torch.zeros(16, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)[0])


def test_any_leading_dimensions_dequantise_as_the_stacked_experts():
    blocks, scales, expected = quantize_mxfp4(_weight((6, 64, 4), seed=3))  # [E, R, G, 16] with E = 2 * 3
    stacked = dequantize_mxfp4(blocks, scales)
    # Two leading dimensions, or none (one expert's [R, G, 16]): the same numbers, [..., G * 32, R].
    nested = dequantize_mxfp4(blocks.unflatten(0, (2, 3)), scales.unflatten(0, (2, 3)))
    assert nested.shape == mxfp4_shape((2, 3, *blocks.shape[1:]), (2, 3, *scales.shape[1:])) == (2, 3, 64, 4)
    assert torch.equal(nested.flatten(0, 1), expected) and torch.equal(stacked, expected)
    single = dequantize_mxfp4(blocks[4], scales[4])
    assert single.shape == mxfp4_shape(tuple(blocks.shape[1:]), tuple(scales.shape[1:])) == (64, 4)
    assert torch.equal(single, expected[4])
    # The flattened blocks' shape is known too.
    assert mxfp4_shape(tuple(blocks.flatten(-2).shape), tuple(scales.shape)) == tuple(expected.shape)


def test_the_dequantised_dtype_is_the_configs():
    assert dequantized_dtype({"dtype": "bfloat16"}) == torch.bfloat16
    assert dequantized_dtype({"torch_dtype": "float16"}) == torch.float16
    assert dequantized_dtype({"dtype": "torch.bfloat16", "torch_dtype": "float32"}) == torch.bfloat16
    assert dequantized_dtype({}) == torch.float32  # transformers' default dtype
    with pytest.raises(ValueError, match="'int8' is not a floating-point"):
        dequantized_dtype({"dtype": "int8"})


def test_pairs_are_found_by_name():
    names = ["a.gate_up_proj_blocks", "a.gate_up_proj_scales", "a.gate_up_proj_bias", "b_blocks"]
    assert mxfp4_pairs(names) == {"a.gate_up_proj": ("a.gate_up_proj_blocks", "a.gate_up_proj_scales")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_convert_moe_packed_tensors(dtype):
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4", reason="needs transformers")
    weight = _weight((2, 64, 8), seed=2)
    weight[1, 32:64, 3] *= 2.0**-90  # tiny scales, near the bottom of the exponent range
    blocks, scales, _ = quantize_mxfp4(weight)
    expected = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), expected)
