"""The model presets in ``examples/configs/models/`` parse, build on the meta device, have the
published parameter counts and equal what ``from_pretrained`` reads from the published config.json.

Parsing goes through jsonargparse, as the CLI does: ``--model preset.yaml`` with
``type=MoETransformerConfig``, so a preset is exactly what a user can pass on the command line.
The published ``config.json`` of each model is written out below (the values of the model
repositories named in each YAML's header; no download): the config mapper of
``lightning_moe.models.hf`` must produce the preset from it, except for the training settings each
preset takes from its paper where ``config.json`` carries another value or none (listed, with why).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from jsonargparse import ArgumentParser

from lightning_moe import MoELayer
from lightning_moe.models import DenseMLP, MoETransformer, MoETransformerConfig, MultiLatentAttention
from lightning_moe.models.hf import config_from_hf

PRESET_DIR = Path(__file__).resolve().parents[2] / "examples" / "configs" / "models"
PRESETS = ("qwen3_30b_a3b", "mixtral_8x7b", "olmoe_1b_7b", "deepseek_v3_style", "kimi_k2", "glm_4_5_air",
           "gpt_oss_20b", "gpt_oss_120b")

# (total, active) from the model cards / papers named in each YAML's header. DeepSeek-V3's are
# those of the main model: its published checkpoint adds a 14B multi-token-prediction module.
PUBLISHED = {
    "qwen3_30b_a3b": (30.5e9, 3.3e9),
    "mixtral_8x7b": (46.7e9, 12.9e9),
    "olmoe_1b_7b": (6.9e9, 1.3e9),
    "deepseek_v3_style": (671e9, 37e9),
    # Kimi K2 technical report (arXiv:2507.20534), Table 2: 1.04T total, 32.6B activated.
    "kimi_k2": (1.04e12, 32.6e9),
}
# Totals are published to three significant digits: our count must be within 1% of them.
REL_TOL = 0.01
# Kimi K2's published 1.04T is 1.3% above the exact count of its config.json's tensor shapes
# (1,026,408,209,408, re-derived by hand below; its checkpoint has no multi-token-prediction
# layer and the fp8 scales add 0.006%): checked to 2%, and pinned exactly.
TOTAL_REL_TOL = {"kimi_k2": 0.02}
# Some actives are published to two significant digits, coarser than 1%: exact counts
# 3,353,032,704 ("3.3B", truncated), 1,282,017,280 ("1.3B", rounded) and 37,552,282,624 ("37B",
# truncated) are 1.6%, 1.4% and 1.5% away. They are checked to within one unit of the published
# last digit and pinned exactly below (counts re-derived by hand from the Hugging Face config.json
# of each model; DeepSeek-V3's total equals the tensor shapes of its published checkpoint without
# the MTP layer model.layers.61 and the fp8 scales).
ACTIVE_DIGIT_TOL = {"qwen3_30b_a3b": 0.1e9, "olmoe_1b_7b": 0.1e9, "deepseek_v3_style": 1e9}
EXACT = {
    "qwen3_30b_a3b": (30_532_122_624, 3_353_032_704),
    "mixtral_8x7b": (46_702_792_704, 12_879_925_248),
    "olmoe_1b_7b": (6_919_161_856, 1_282_017_280),
    "deepseek_v3_style": (671_026_404_352, 37_552_282_624),
    # Kimi K2 by hand: embedding + head 2 x 163840 x 7168 = 2,348,810,240; final norm 7,168; per
    # layer MLA 101,124,096 (q_a 1536x7168, q_a_norm 1536, q_b 64x192x1536, kv_a 576x7168,
    # kv_a_norm 512, kv_b 64x256x512, o 7168x8192) + two norms 14,336, x 61; dense layer 0
    # 3 x 7168 x 18432 = 396,361,728; 60 MoE layers of router 384 x 7168 + 385 experts (384 routed,
    # 1 shared) of 3 x 2048 x 7168 = 16,958,226,432 each (active: router + 9 experts = 399,114,240).
    "kimi_k2": (1_026_408_209_408, 32_861_477_888),
    # GLM-4.5-Air by hand: embedding + head 2 x 151552 x 4096 = 1,241,513,984; final norm 4,096; per
    # layer attention 109,066,240 (q 12288 x 4096, k and v 1024 x 4096, o 4096 x 12288, biases
    # 12288 + 2 x 1024) + two norms 8,192, x 46; dense layer 0 3 x 4096 x 10944 = 134,479,872; 45
    # MoE layers of router 128 x 4096 + 129 experts (128 routed, 1 shared) of 3 x 1408 x 4096 =
    # 2,232,418,304 each (active: router + 9 experts = 156,237,824).
    "glm_4_5_air": (106_852_245_504, 13_424_123_904),
    # gpt-oss by hand: embedding + head 2 x 201088 x 2880 = 1,158,266,880; final norm 2,880; per layer
    # attention 26,550,144 (q 4096 x 2880, k and v 512 x 2880, o 2880 x 4096, biases 4096 + 2 x 512 +
    # 2880, sinks 64) + two norms 5,760 + router 2880 x E + E + E experts of 24,891,840 each (gate_up
    # 5760 x 2880 + 5760, down 2880 x 2880 + 2880); 20b: 24 layers, E = 32 (active: router + 4 experts);
    # 120b: 36 layers, E = 128.
    "gpt_oss_20b": (20_914_757_184, 4_187_440_704),
    "gpt_oss_120b": (116_829_156_672, 5_711_982_912),
}
# gpt-oss model card, Table 1 (total, active): the active counts leave out the embedding table (a
# lookup) and keep the unembedding; the card's summary rounds them to 21B / 3.6B and 117B / 5.1B.
GPT_OSS_CARD = {"gpt_oss_20b": (20.91e9, 3.61e9), "gpt_oss_120b": (116.83e9, 5.13e9)}

# The published config.json of each preset's model (keys transformers reads; token ids and
# bookkeeping such as torch_dtype and transformers_version left out).
PUBLISHED_CONFIG_JSON = {
    "qwen3_30b_a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
        "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
        "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
        "use_sliding_window": False, "vocab_size": 151936,
    },
    "mixtral_8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "num_attention_heads": 32, "num_experts_per_tok": 2,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
        "tie_word_embeddings": False, "vocab_size": 32000,
    },
    "olmoe_1b_7b": {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "attention_bias": False,
        "attention_dropout": 0.0, "clip_qkv": None, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 1024, "max_position_embeddings": 4096,
        "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
        "num_hidden_layers": 16, "num_key_value_heads": 16, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False, "vocab_size": 50304,
    },
    "deepseek_v3_style": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
        "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "ep_size": 1, "first_k_dense_replace": 3,
        "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
        "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
        "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128,
        "vocab_size": 129280,
    },
    # moonshotai/Kimi-K2-Instruct's config.json; its quantization_config (fp8 blocks of 128 x 128)
    # is left out: the mapping refuses quantised checkpoints, which are dequantized first.
    "kimi_k2": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "attention_bias": False,
        "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "first_k_dense_replace": 1,
        "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
        "kv_lora_rank": 512, "max_position_embeddings": 131072, "moe_intermediate_size": 2048,
        "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64,
        "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "v_head_dim": 128,
        "vocab_size": 163840,
    },
    # zai-org/GLM-4.5-Air's config.json (its MTP layer, num_nextn_predict_layers 1, is skipped on load).
    "glm_4_5_air": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
        "attention_dropout": 0.0, "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 10944,
        "max_position_embeddings": 131072, "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8,
        "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 1,
        "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
        "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1, "use_qk_norm": False,
        "vocab_size": 151552,
    },
}


def _gpt_oss_config_json(layers: int, experts: int) -> dict:
    # openai/gpt-oss-{20b,120b}'s config.json differ only in the layer and expert counts.
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2), "max_position_embeddings": 131072,
        "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": layers, "num_key_value_heads": 8,
        "num_local_experts": experts, "output_router_logits": False,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
    }


PUBLISHED_CONFIG_JSON["gpt_oss_20b"] = _gpt_oss_config_json(24, 32)
PUBLISHED_CONFIG_JSON["gpt_oss_120b"] = _gpt_oss_config_json(36, 128)

# Training settings a preset takes from its paper: (top-level fields, moe fields), and why.
FROM_THE_PAPER = {
    # OLMoE paper §3: router z-loss 0.001; config.json has no z-loss field.
    "olmoe_1b_7b": ({}, {"z_loss_coeff": 0.001}),
    # DeepSeek-V3 Technical Report §4.2: init std 0.006 and balance factor 0.0001, where
    # config.json says initializer_range 0.02 and aux_loss_alpha 0.001.
    "deepseek_v3_style": ({"init_std": 0.006}, {"init_std": 0.006, "aux_loss_coeff": 0.0001}),
}


def load_preset(name: str) -> MoETransformerConfig:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--model", type=MoETransformerConfig)
    namespace = parser.parse_args(["--model", str(PRESET_DIR / f"{name}.yaml")])
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # jsonargparse < 4.49
    config = instantiate(namespace).model
    assert isinstance(config, MoETransformerConfig)
    return config


def test_every_preset_is_tested():
    assert sorted(path.stem for path in PRESET_DIR.glob("*.yaml")) == sorted(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_builds_on_meta_with_the_analytic_parameter_count(name):
    config = load_preset(name)
    with torch.device("meta"):
        model = MoETransformer(config)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()
    assert config.num_parameters(active=True) < config.num_parameters()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_matches_published_counts(name):
    config = load_preset(name)
    total, active = config.num_parameters(), config.num_parameters(active=True)
    published_total, published_active = PUBLISHED[name]
    total_tol = TOTAL_REL_TOL.get(name, REL_TOL)
    assert abs(total - published_total) <= total_tol * published_total, f"{total:,} vs {published_total:,.0f}"
    assert abs(active - published_active) <= max(REL_TOL * published_active, ACTIVE_DIGIT_TOL.get(name, 0)), (
        f"{active:,} vs {published_active:,.0f}"
    )
    assert (total, active) == EXACT[name]


def test_qwen3_non_embedding_count_matches_model_card():
    # The Qwen3-30B-A3B card also lists 29.9B non-embedding parameters (embedding and head excluded).
    config = load_preset("qwen3_30b_a3b")
    non_embedding = config.num_parameters() - 2 * config.vocab_size * config.hidden_size
    assert abs(non_embedding - 29.9e9) <= REL_TOL * 29.9e9


@pytest.mark.parametrize("name", PRESETS)
def test_preset_equals_what_from_pretrained_reads_from_the_published_config_json(name):
    mapped, family = config_from_hf(PUBLISHED_CONFIG_JSON[name])
    # Kimi K2's model_type names its copy of DeepSeek-V3's code: it reads as deepseek_v3.
    assert family == {"kimi_k2": "deepseek_v3"}.get(PUBLISHED_CONFIG_JSON[name]["model_type"],
                                                    PUBLISHED_CONFIG_JSON[name]["model_type"])
    top, moe = FROM_THE_PAPER.get(name, ({}, {}))
    expected = dataclasses.replace(mapped, **top, moe=dataclasses.replace(mapped.moe, **moe))
    preset = load_preset(name)
    differences = {
        f.name: (getattr(preset, f.name), getattr(expected, f.name))
        for f in dataclasses.fields(MoETransformerConfig)
        if getattr(preset, f.name) != getattr(expected, f.name)
    }
    assert not differences, differences


def test_deepseek_v3_style_layout():
    config = load_preset("deepseek_v3_style")
    assert config.moe_layers == list(range(3, 61))
    with torch.device("meta"):
        model = MoETransformer(config)
    attention = model.layers[0].attn
    assert isinstance(attention, MultiLatentAttention)
    assert attention.q_down_proj.weight.shape == (1536, 7168)
    assert attention.q_up_proj.weight.shape == (128 * 192, 1536)
    assert attention.kv_down_proj.weight.shape == (512 + 64, 7168)
    assert attention.kv_up_proj.weight.shape == (128 * 256, 512)
    assert attention.o_proj.weight.shape == (7168, 128 * 128)
    assert all(isinstance(model.layers[i].ffn, DenseMLP) for i in range(3))
    assert model.layers[0].ffn.gate_proj.weight.shape == (18432, 7168)
    moe = model.layers[3].ffn
    assert isinstance(moe, MoELayer)
    assert moe.experts.fc1_weight.shape == (256, 2 * 2048, 7168)
    assert moe.shared_expert.fc1.weight.shape == (2 * 2048, 7168)
    assert moe.router.expert_bias.shape == (256,)
    assert (config.moe.num_groups, config.moe.group_top_k, config.moe.topk_scaling_factor) == (8, 4, 2.5)


def test_glm_4_5_air_counts_match_the_model_card_without_embeddings():
    # The card's 106B total and 12B active exclude the embedding and the output head.
    config = load_preset("glm_4_5_air")
    embeddings = 2 * config.vocab_size * config.hidden_size
    total, active = config.num_parameters() - embeddings, config.num_parameters(active=True) - embeddings
    assert abs(total - 106e9) <= REL_TOL * 106e9, f"{total:,}"
    assert abs(active - 12e9) <= 0.5e9, f"{active:,}"  # "12B": two significant digits
    assert (config.num_parameters(), config.num_parameters(active=True)) == EXACT["glm_4_5_air"]


def test_glm_4_5_air_attention_shapes():
    config = load_preset("glm_4_5_air")
    assert config.rotary_dim == 64 and config.moe_layers == list(range(1, 46))
    with torch.device("meta"):
        model = MoETransformer(config)
    attn = model.layers[0].attn
    assert attn.q_proj.weight.shape == (96 * 128, 4096) and attn.q_proj.bias.shape == (96 * 128,)
    assert attn.k_proj.bias.shape == attn.v_proj.bias.shape == (8 * 128,)
    assert attn.o_proj.bias is None and attn.q_norm is None
    assert model.layers[1].ffn.shared_expert.fc1.weight.shape == (2 * 1408, 4096)


def test_kimi_k2_layout():
    config = load_preset("kimi_k2")
    assert config.moe_layers == list(range(1, 61))
    assert (config.num_attention_heads, config.rope_theta, config.vocab_size) == (64, 50000.0, 163840)
    assert (config.rope_scaling.factor, config.rope_scaling.original_max_seq_len) == (32.0, 4096)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.num_groups, moe.topk_scaling_factor) == (384, 8, None, 2.827)
    with torch.device("meta"):
        model = MoETransformer(config)
    assert model.layers[1].ffn.experts.fc1_weight.shape == (384, 2 * 2048, 7168)
    assert model.layers[0].attn.q_up_proj.weight.shape == (64 * 192, 1536)
    assert isinstance(model.layers[0].ffn, DenseMLP)


@pytest.mark.parametrize("name", sorted(GPT_OSS_CARD))
def test_gpt_oss_counts_match_the_model_card(name):
    config = load_preset(name)
    total, active = config.num_parameters(), config.num_parameters(active=True)
    card_total, card_active = GPT_OSS_CARD[name]
    embedding = config.vocab_size * config.hidden_size
    # The card's table gives two decimals of a billion.
    assert abs(total - card_total) <= 0.005e9, f"{total:,}"
    assert abs(active - embedding - card_active) <= 0.005e9, f"{active - embedding:,}"
    assert (total, active) == EXACT[name]


def test_gpt_oss_layout():
    config = load_preset("gpt_oss_120b")
    assert config.layer_types == ["sliding_attention", "full_attention"] * 18
    assert [config.layer_window(i) for i in range(2)] == [128, None]
    with torch.device("meta"):
        model = MoETransformer(config)
    attn, moe = model.layers[0].attn, model.layers[0].ffn
    assert attn.q_proj.weight.shape == (64 * 64, 2880) and attn.k_proj.bias.shape == (8 * 64,)
    assert attn.o_proj.bias.shape == (2880,) and attn.sinks.shape == (64,)
    assert moe.experts.fc1_weight.shape == (128, 2 * 2880, 2880) and moe.experts.fc2_bias.shape == (128, 2880)
    assert moe.router.bias.shape == (128,)


def test_qwen3_attention_shapes():
    config = load_preset("qwen3_30b_a3b")
    with torch.device("meta"):
        model = MoETransformer(config)
    attn = model.layers[0].attn
    assert attn.q_proj.weight.shape == (32 * 128, 2048)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (4 * 128, 2048)
    assert attn.q_norm.weight.shape == (128,)
    assert model.lm_head.weight is not model.embed.weight


def test_cli_style_overrides_parse(tmp_path):
    # A list-valued moe_layer_freq and a nested moe section, overridden on the command line.
    path = tmp_path / "tiny.yaml"
    path.write_text(
        "vocab_size: 256\nhidden_size: 64\nnum_layers: 4\nnum_attention_heads: 4\nffn_hidden_size: 128\n"
        "moe_layer_freq: [0, 1, 0, 1]\nmoe:\n  hidden_size: 64\n  ffn_hidden_size: 32\n  num_experts: 4\n"
    )
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--model", type=MoETransformerConfig)
    overrides = ["--model.moe.top_k", "1", "--model.moe.pre_softmax", "true"]
    namespace = parser.parse_args(["--model", str(path), *overrides])
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    config = instantiate(namespace).model
    assert config.moe_layers == [1, 3]
    assert (config.moe.top_k, config.moe.pre_softmax) == (1, True)
