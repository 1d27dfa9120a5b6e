"""GPT-OSS's MoE block tensors: read into a `MoELayer` (plain and MXFP4), written back, and read in slices.

The oracle of the numbers is ``transformers``' own ``GptOssMLP`` (router, interleaved gate/up,
biases, clamped SwiGLU) on a tiny random config; MXFP4 checkpoints are made with the reference
quantiser of ``helpers.mxfp4``. The sliced reads (``init_from``: each rank its experts and ETP
blocks) are compared with the same block cut from the whole tensor.
"""

from __future__ import annotations

import pytest
import torch
from helpers.mxfp4 import quantize_mxfp4

from lightning_moe.layers.moe import MoELayer
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.config_map import moe_config_from_hf
from lightning_moe.models.hf.families.gpt_oss import gpt_oss_moe_sources
from lightning_moe.models.hf.weights import hf_pieces, hf_sources, read_source, source_names, split_source

transformers = pytest.importorskip("transformers", reason="the oracle is transformers' GptOssMLP")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss", reason="needs transformers' gpt_oss")

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 32, 32, 4, 2, 9  # multiples of 32: MXFP4 blocks
PREFIX = "model.layers.0.mlp"
OUT_TOL = 1e-5


def _hf_block(seed: int = 0):
    config = transformers.GptOssConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64,
        swiglu_limit=1.5,  # small enough that the clamps act at these weight scales
    )
    block = gpt_oss.GptOssMLP(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return config, block


def _checkpoint(block) -> dict[str, torch.Tensor]:
    return {f"{PREFIX}.{name}": tensor.detach().clone() for name, tensor in block.state_dict().items()}


def _our_layer(config, state: dict[str, torch.Tensor]) -> MoELayer:
    layer = MoELayer(moe_config_from_hf(config.to_dict(), "gpt_oss"))
    layer.load_state_dict(state)
    return layer


def _read(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: read_source(source, checkpoint.__getitem__) for key, source in gpt_oss_moe_sources(PREFIX).items()}


def _model_config(config) -> MoETransformerConfig:
    """A model whose MoE layers are GPT-OSS's (the attention is not what these tests read)."""
    return MoETransformerConfig(
        vocab_size=64, hidden_size=HIDDEN, num_layers=1, num_attention_heads=2, max_seq_len=16, qk_norm=False,
        moe=moe_config_from_hf(config.to_dict(), "gpt_oss"),
    )


def _compare(layer: MoELayer, block, x: torch.Tensor) -> None:
    with torch.no_grad():
        expected, _ = block(x.unsqueeze(0))
        got = layer(x)
    err = (got - expected[0]).abs().max().item()
    assert err <= OUT_TOL * expected.abs().max().item(), err


def test_moe_block_matches_transformers():
    config, block = _hf_block()
    layer = _our_layer(config, _read(_checkpoint(block)))
    assert layer.config.activation == "clamped_swiglu" and layer.config.activation_limit == 1.5
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    _compare(layer, block, x)


def test_write_back_is_bitwise():
    config, block = _hf_block(seed=2)
    checkpoint = _checkpoint(block)
    layer = _our_layer(config, _read(checkpoint))
    model_config = _model_config(config)
    written = {}
    for key, value in layer.state_dict().items():
        written.update(hf_pieces(f"layers.0.ffn.{key}", value, model_config, "gpt_oss"))
    assert set(written) == set(checkpoint)
    for name, tensor in checkpoint.items():
        assert torch.equal(written[name], tensor), name
    # The de-interleaved fc1 is [gate ; up]: gate rows are the even columns of gate_up_proj.
    gate_up = checkpoint[f"{PREFIX}.experts.gate_up_proj"]
    assert torch.equal(layer.experts.fc1_weight[:, :FFN], gate_up[..., ::2].transpose(1, 2))
    assert torch.equal(layer.experts.fc1_bias[:, 1], checkpoint[f"{PREFIX}.experts.gate_up_proj_bias"][:, 1::2])
    # split_source inverts every source.
    for key, source in gpt_oss_moe_sources(PREFIX).items():
        value = read_source(source, checkpoint.__getitem__)
        assert all(torch.equal(v, checkpoint[k]) for k, v in split_source(source, value).items()), key


def _mxfp4_checkpoint(block) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The block's tensors with its expert projections as MXFP4, and the values those stand for."""
    checkpoint, dequantised = _checkpoint(block), {}
    for name in ("gate_up_proj", "down_proj"):
        key = f"{PREFIX}.experts.{name}"
        blocks, scales, values = quantize_mxfp4(checkpoint.pop(key))
        checkpoint[key + "_blocks"], checkpoint[key + "_scales"] = blocks, scales
        dequantised[key] = values
    return checkpoint, dequantised


def test_mxfp4_checkpoint_loads_dequantised():
    config, block = _hf_block(seed=3)
    checkpoint, dequantised = _mxfp4_checkpoint(block)
    model_config = _model_config(config)
    expected = [f"layers.0.ffn.{key}" for key in gpt_oss_moe_sources(PREFIX)]
    sources = hf_sources(checkpoint.keys(), model_config, "gpt_oss", expected)
    assert {name for source in sources.values() for name in source_names(source)} == set(checkpoint)
    state = {key.removeprefix("layers.0.ffn."): read_source(source, checkpoint.__getitem__)
             for key, source in sources.items()}
    layer = _our_layer(config, state)
    # The oracle: transformers' block holding the values the MXFP4 pair stands for.
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(dequantised[f"{PREFIX}.experts.gate_up_proj"])
        block.experts.down_proj.copy_(dequantised[f"{PREFIX}.experts.down_proj"])
    _compare(layer, block, torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(4)))


def test_sliced_reads_equal_the_block_of_the_whole_tensor(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch", reason="the sliced reader reads safetensors files")
    from lightning_moe.checkpoint.hf_load import _SliceReader
    from lightning_moe.models.hf.io import SafetensorsReader

    config, block = _hf_block(seed=5)
    checkpoint, _ = _mxfp4_checkpoint(block)
    safetensors.save_file({k: v.contiguous() for k, v in checkpoint.items()}, str(tmp_path / "model.safetensors"))
    model_config = _model_config(config)
    expected = [f"layers.0.ffn.{key}" for key in gpt_oss_moe_sources(PREFIX)]
    sources = hf_sources(checkpoint.keys(), model_config, "gpt_oss", expected)
    half = FFN // 2
    # (experts, ETP rank 1 of 2's F blocks) as a rank holds them; fc1's [gate ; up] rows in two ranges.
    boxes = {
        "layers.0.ffn.experts.fc1_weight": [[(1, 3)], [(half, FFN), (FFN + half, 2 * FFN)], [(0, HIDDEN)]],
        "layers.0.ffn.experts.fc1_bias": [[(2, 4)], [(0, 2)], [(half, FFN)]],
        "layers.0.ffn.experts.fc2_weight": [[(0, 2)], [(0, HIDDEN)], [(half, FFN)]],
        "layers.0.ffn.experts.fc2_bias": [[(3, 4)], [(0, HIDDEN)]],
        "layers.0.ffn.router.bias": [[(0, EXPERTS)]],
    }
    with SafetensorsReader(tmp_path) as files:
        reader = _SliceReader(files)
        for key, ranges in boxes.items():
            whole = read_source(sources[key], checkpoint.__getitem__)
            assert reader.shape(sources[key]) == tuple(whole.shape), key
            part = whole
            for dim, pieces in enumerate(ranges):
                part = torch.cat([part.narrow(dim, a, b - a) for a, b in pieces], dim=dim)
            assert torch.equal(reader.read(sources[key], ranges), part), key
        # fc1 reads exactly the packed bytes and scales of its experts' rows, each once: the ETP block's
        # gate and up rows are one span of the interleaved rows.
        packed = checkpoint[f"{PREFIX}.experts.gate_up_proj_blocks"]
        scales = checkpoint[f"{PREFIX}.experts.gate_up_proj_scales"]
        for ranges, experts, rows in (
            ([[(0, 1)], [(0, 2 * FFN)], [(0, HIDDEN)]], slice(0, 1), slice(0, 2 * FFN)),
            (boxes["layers.0.ffn.experts.fc1_weight"], slice(1, 3), slice(2 * half, 2 * FFN)),
        ):
            before = reader.bytes_read
            reader.read(sources["layers.0.ffn.experts.fc1_weight"], ranges)
            assert reader.bytes_read - before == packed[experts, rows].numel() + scales[experts, rows].numel()
