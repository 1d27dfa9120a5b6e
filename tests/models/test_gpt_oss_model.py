"""GPT-OSS whole models: ``MoETransformer.from_pretrained`` / ``save_pretrained`` against ``transformers``.

Oracle: ``transformers``' ``GptOssForCausalLM`` built tiny from a config with random weights (no
download), every bias and sink moved off its initial value (the expert biases start at zero, the
norms at one) so a swapped or missing tensor shows, and written with its own ``save_pretrained``.
The tiny configs make what GPT-OSS does bind at these sizes: sliding and full attention
alternate with a window shorter than the sequence, the clamped SwiGLU's ``swiglu_limit`` is small
enough to clamp, the rotary embedding is YaRN. As ``test_hf_families.py``: the same logits (fp32,
1e-5 of the logits' scale, real positions only when padded), a directory ``transformers`` loads
back to the same logits, every tensor round-tripped bit for bit. An MXFP4 checkpoint (experts
quantised by the reference quantiser of ``helpers.mxfp4``) loads equal to ``transformers``'
dequantised model.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers.asserts import assert_close_to_scale
from helpers.gpt_oss import random_gpt_oss, write_mxfp4_directory

from lightning_moe.models import MoETransformer

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="the hf and test extras install safetensors")
pytest.importorskip("transformers.models.gpt_oss", reason="needs transformers' gpt_oss")

LOGITS_TOL = 1e-5
VOCAB, BATCH, SEQ, PAD, WINDOW = 96, 2, 12, 4, 4


def _configs() -> dict[str, object]:
    # hidden and intermediate sizes are multiples of 32: the MXFP4 blocks.
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, max_position_embeddings=64,
                  initializer_range=0.1, bos_token_id=0, eos_token_id=2, pad_token_id=1, swiglu_limit=1.0,
                  num_attention_heads=4, head_dim=16, num_local_experts=4, num_experts_per_tok=2)
    return {
        # Explicit layer_types (sliding, full, sliding), GQA, YaRN with GPT-OSS's truncate=False.
        "gpt_oss": transformers.GptOssConfig(
            **common, num_hidden_layers=3, num_key_value_heads=2, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
        ),
        # transformers' defaults: alternation from num_hidden_layers, its YaRN; one kv head, three of the
        # four experts chosen.
        "gpt_oss-defaults": transformers.GptOssConfig(
            **{**common, "num_experts_per_tok": 3}, num_hidden_layers=2, num_key_value_heads=1,
            sliding_window=WINDOW + 1,
        ),
    }


@pytest.fixture(scope="module", params=sorted(_configs()))
def hf_gpt_oss(request, tmp_path_factory):
    """(name, transformers model, directory written by its save_pretrained)."""
    model = random_gpt_oss(_configs()[request.param])
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B, S] and HF's attention mask (1 = real) with the second sample right-padded."""
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -PAD:] = 0
    tokens[1, -PAD:] = 1  # pad_token_id
    return tokens, mask


def _hf_logits(model, tokens, mask=None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, attention_mask=mask).logits


def _ours_logits(model, tokens, mask=None) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, padding_mask=None if mask is None else mask == 0)


def _files(path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(safetensors_torch.load_file(file))
    return tensors


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "right-padded"])
def test_from_pretrained_logits_equal_transformers(hf_gpt_oss, padded):
    name, hf_model, path = hf_gpt_oss
    ours = MoETransformer.from_pretrained(path).eval()
    tokens, mask = _batch()
    mask = mask if padded else None
    expected, actual = _hf_logits(hf_model, tokens, mask), _ours_logits(ours, tokens, mask)
    real = torch.ones(BATCH, SEQ, dtype=torch.bool) if mask is None else mask.bool()
    assert_close_to_scale(actual[real], expected[real], LOGITS_TOL, f"{name} logits")


def test_config_maps_every_gpt_oss_feature(hf_gpt_oss):
    _, hf_model, path = hf_gpt_oss
    config = MoETransformer.from_pretrained(path).config
    hf = hf_model.config
    assert config.layer_types == list(hf.layer_types) and config.sliding_window == hf.sliding_window
    assert config.attention_sinks and config.attention_bias and config.attention_out_bias
    assert (config.attention_head_dim, config.kv_heads) == (hf.head_dim, hf.num_key_value_heads)
    moe = config.moe
    assert (moe.activation, moe.activation_alpha, moe.activation_limit) == ("clamped_swiglu", hf.swiglu_alpha,
                                                                            hf.swiglu_limit)
    assert moe.fc1_bias and moe.fc2_bias and moe.router_bias and not moe.pre_softmax
    assert config.rope_scaling is not None and config.rope_scaling.factor == hf.rope_parameters["factor"]
    assert config.rope_scaling.truncate is False and config.rope_theta == hf.rope_parameters["rope_theta"]


def test_the_window_and_sinks_bind_at_this_length(hf_gpt_oss):
    # Without this the logits test could pass with the window or the sinks ignored.
    _, hf_model, path = hf_gpt_oss
    ours = MoETransformer.from_pretrained(path).eval()
    tokens, _ = _batch()
    expected = _hf_logits(hf_model, tokens)
    for change in ({"layer_types": None, "sliding_window": None}, {"attention_sinks": False}):
        other = MoETransformer(dataclasses.replace(ours.config, **change)).eval()
        other.load_state_dict(ours.state_dict(), strict=False)
        gap = (_ours_logits(other, tokens) - expected).abs().max()
        assert gap > 100 * LOGITS_TOL * expected.abs().max(), change


def test_save_pretrained_loads_in_transformers_and_round_trips_bitwise(hf_gpt_oss, tmp_path):
    name, hf_model, path = hf_gpt_oss
    ours = MoETransformer.from_pretrained(path)
    ours.save_pretrained(tmp_path)
    theirs_files, ours_files = _files(path), _files(tmp_path)
    assert sorted(ours_files) == sorted(theirs_files)
    for key, tensor in theirs_files.items():
        assert ours_files[key].dtype == tensor.dtype and torch.equal(ours_files[key], tensor), key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(hf_model)
    assert reloaded.config.layer_types == hf_model.config.layer_types
    assert reloaded.config.rope_parameters == hf_model.config.rope_parameters
    tokens, mask = _batch()
    real = mask.bool()
    assert_close_to_scale(_hf_logits(reloaded, tokens, mask)[real], _hf_logits(hf_model, tokens, mask)[real],
                          LOGITS_TOL, name)
    again = MoETransformer.from_pretrained(tmp_path)
    assert again.config == ours.config
    for key, value in ours.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (0, 2, 1)


def test_mxfp4_checkpoint_loads_as_transformers_dequantises_it(hf_gpt_oss, tmp_path):
    name, _, path = hf_gpt_oss
    write_mxfp4_directory(path, tmp_path / "mxfp4")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "mxfp4", quantization_config=transformers.Mxfp4Config(dequantize=True)
    ).eval()
    ours = MoETransformer.from_pretrained(tmp_path / "mxfp4").eval()
    tokens, mask = _batch()
    real = mask.bool()
    expected = _hf_logits(theirs, tokens, mask)
    assert_close_to_scale(_ours_logits(ours, tokens, mask)[real], expected[real], LOGITS_TOL, f"{name} mxfp4")
    # The quantisation changed the experts (so the comparison above is not of the unquantised model).
    plain = MoETransformer.from_pretrained(path)
    assert not torch.equal(plain.layers[0].ffn.experts.fc1_weight, ours.layers[0].ffn.experts.fc1_weight)
    # Saved dequantised: a plain checkpoint transformers loads without quantisation, same logits.
    ours.save_pretrained(tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert "quantization_config" not in written
    assert not any(key.endswith(("_blocks", "_scales")) for key in _files(tmp_path / "ours"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert_close_to_scale(_hf_logits(reloaded, tokens, mask)[real], expected[real], LOGITS_TOL, f"{name} saved")


def test_other_quantisations_are_refused(hf_gpt_oss, tmp_path):
    _, _, path = hf_gpt_oss
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    tmp_path.joinpath("config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config.*fp8"):
        MoETransformer.from_pretrained(tmp_path)


def test_a_model_without_a_source_config_is_written_as_gpt_oss(hf_gpt_oss, tmp_path):
    # The config.json written from the MoETransformerConfig alone (config_to_hf, the family inferred
    # from the clamped SwiGLU), not the source's kept: transformers must build the same model from it.
    name, hf_model, path = hf_gpt_oss
    loaded = MoETransformer.from_pretrained(path)
    ours = MoETransformer(loaded.config)
    ours.load_state_dict(loaded.state_dict())
    ours.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "gpt_oss" and "quantization_config" not in written
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    for key in ("layer_types", "sliding_window", "swiglu_limit", "swiglu_alpha", "head_dim", "attention_bias",
                "num_local_experts", "num_experts_per_tok"):
        assert getattr(reloaded.config, key) == getattr(hf_model.config, key), key
    # The older rope_scaling key written alongside adds its "type" to transformers' rope_parameters.
    rope = {k: v for k, v in reloaded.config.rope_parameters.items() if k != "type"}
    assert rope == hf_model.config.rope_parameters
    tokens, mask = _batch()
    real = mask.bool()
    assert_close_to_scale(_hf_logits(reloaded, tokens, mask)[real], _hf_logits(hf_model, tokens, mask)[real],
                          LOGITS_TOL, name)


def test_absent_keys_take_transformers_defaults(hf_gpt_oss, tmp_path):
    # A config.json without rope settings nor layer_types: transformers' GptOssConfig fills in its
    # YaRN and the alternation (sliding on even layers); the mapping must read the same.
    from lightning_moe.models.hf import config_from_hf

    _, _, path = hf_gpt_oss
    raw = json.loads((path / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling", "rope_theta", "layer_types"):
        raw.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    config, family = config_from_hf(raw)
    rope, scaling = theirs.rope_parameters, config.rope_scaling
    assert family == "gpt_oss" and rope["rope_type"] == "yarn"
    assert (scaling.factor, scaling.original_max_seq_len, scaling.beta_fast, scaling.beta_slow, scaling.truncate) == (
        rope["factor"], rope["original_max_position_embeddings"], rope["beta_fast"], rope["beta_slow"], rope["truncate"])
    assert config.rope_theta == rope["rope_theta"]
    assert config.layer_types == list(theirs.layer_types)


def _expected_experts(theirs, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' dequantised experts of ``layer`` in our layout: fc1 ``[E, 2F, H]`` (the gate rows
    then the up rows, de-interleaved from gate_up_proj's columns), fc2 ``[E, H, F]``."""
    experts = theirs.model.layers[layer].mlp.experts
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()  # [E, H, 2F], [E, F, H]
    fc1 = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2)
    return fc1, down.transpose(1, 2)


def test_bf16_mxfp4_checkpoint_loads_bf16_experts_as_transformers_does(tmp_path):
    from lightning_moe.checkpoint.hf_load import load_hf_weights

    config = _configs()["gpt_oss"]
    random_gpt_oss(config).to(torch.bfloat16).save_pretrained(tmp_path / "plain")
    write_mxfp4_directory(tmp_path / "plain", tmp_path / "mxfp4")
    assert json.loads((tmp_path / "mxfp4" / "config.json").read_text())["dtype"] == "bfloat16"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "mxfp4", quantization_config=transformers.Mxfp4Config(dequantize=True)
    )
    ours = MoETransformer.from_pretrained(tmp_path / "mxfp4")
    # The same model built from the config and filled as init_from fills it (each rank its slices).
    sliced = MoETransformer(ours.config).to(torch.bfloat16)
    load_hf_weights(sliced, tmp_path / "mxfp4")
    for model in (ours, sliced):
        for i in ours.config.moe_layers:
            experts = model.layers[i].ffn.experts
            fc1, fc2 = _expected_experts(theirs, i)
            assert fc1.dtype == fc2.dtype == torch.bfloat16
            assert experts.fc1_weight.dtype == experts.fc2_weight.dtype == experts.fc1_bias.dtype == torch.bfloat16
            assert torch.equal(experts.fc1_weight.detach(), fc1) and torch.equal(experts.fc2_weight.detach(), fc2)
    # dtype= still casts every tensor, the experts included.
    wide = MoETransformer.from_pretrained(tmp_path / "mxfp4", dtype=torch.float32)
    assert wide.layers[0].ffn.experts.fc1_weight.dtype == torch.float32
    assert torch.equal(wide.layers[0].ffn.experts.fc1_weight, _expected_experts(theirs, 0)[0].float())
    # Saved as the model holds it: bf16 expert projections under "dtype": "bfloat16".
    ours.save_pretrained(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["dtype"] == "bfloat16"
    written = _files(tmp_path / "ours")
    projections = [k for k in written if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert projections and all(written[k].dtype == torch.bfloat16 for k in projections)
