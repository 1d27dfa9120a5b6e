"""Hugging Face model directories: ``MoETransformer.from_pretrained`` / ``save_pretrained``.

Oracle: ``transformers``' own implementation of each family (Qwen3-MoE, Mixtral, OLMoE,
DeepSeek-V3), built tiny from a config with random weights (no download; every norm weight and
DeepSeek's expert-score bias perturbed away from their initial values so a swapped or missing
tensor shows) and written with its own ``save_pretrained``. Ours must give the same logits (fp32,
1e-5 of the logits' scale), write a directory that ``transformers`` loads back to the same
logits, and round-trip every tensor bit for bit, dtype included.

Padding: Hugging Face's ``attention_mask`` is 1 on real tokens, our ``padding_mask`` True on
padding. Only real positions are compared: with right padding a real token attends to real
tokens only in both models, but a padded query row attends to every earlier key in ours (causal
only) and to the real keys only in ``transformers``, so the padded rows differ by design. Both
models route padded tokens (ours keeps them out of the losses and expert-bias counts only), and
dropless routing makes no token's output depend on another's routing.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers.asserts import assert_close_to_scale
from helpers.hf import random_hf_model

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, MoETransformerConfig

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="the hf and test extras install safetensors")

# fp32 forward passes through differently blocked kernels (SDPA, grouped expert GEMMs): ulps.
LOGITS_TOL = 1e-5
VOCAB, BATCH, SEQ, PAD = 96, 2, 12, 4


def _family_configs() -> dict[str, object]:
    common = dict(vocab_size=VOCAB, hidden_size=32, max_position_embeddings=64, initializer_range=0.1,
                  bos_token_id=0, eos_token_id=2, pad_token_id=1)
    return {
        # Explicit head_dim != hidden / heads, GQA, a dense layer (mlp_only_layers), renormalised top-k.
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        ),
        # Softmax before top-k without renormalising, YaRN (cos/sin scaled), tied head, sparse step 2.
        "qwen3_moe-yarn-tied": transformers.Qwen3MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=3,
            norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                             "original_max_position_embeddings": 16},
        ),
        "mixtral": transformers.MixtralConfig(
            **common, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        # q/k RMSNorm over the whole projection (k over kv_heads * head_dim with GQA).
        "olmoe": transformers.OlmoeConfig(
            **common, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts=8, num_experts_per_tok=2,
        ),
        # MLA with q LoRA, interleaved rope and YaRN mscale; sigmoid router with score bias, groups,
        # scaling; two shared experts; one dense first layer.
        "deepseek_v3": transformers.DeepseekV3Config(
            **common, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=4,
            n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=2, routed_scaling_factor=2.5,
            kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
            num_mtp_layers=0,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                             "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0.8},
        ),
        # q/k/v biases (qkv_bias defaults to true), a shared expert with its sigmoid gate, GQA, a dense
        # layer (mlp_only_layers), top-k not renormalised (norm_topk_prob defaults to false).
        "qwen2_moe": transformers.Qwen2MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
            num_experts_per_tok=2, mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        ),
        # Sparse step 2, renormalised top-k, explicit head_dim, tied head, YaRN.
        "qwen2_moe-step2-tied-yarn": transformers.Qwen2MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=12, num_experts=6,
            num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=2, tie_word_embeddings=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                             "original_max_position_embeddings": 16},
        ),
        # Partial rotary (half of each head), q/k norm per head, q/k/v biases; DeepSeek-V3's router
        # with groups and scaling; two shared experts; one dense first layer.
        "glm4_moe": transformers.Glm4MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=4,
            n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=2, routed_scaling_factor=2.5,
            use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5, num_mtp_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        ),
        # No q/k norm nor biases, a quarter of each head rotated with YaRN, no groups, no scaling.
        "glm4_moe-plain-yarn": transformers.Glm4MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=6, num_experts_per_tok=2,
            first_k_dense_replace=0, n_shared_experts=1, use_qk_norm=False, attention_bias=False,
            num_mtp_layers=0,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "partial_rotary_factor": 0.25,
                             "original_max_position_embeddings": 16},
        ),
    }


def _build_hf(config) -> torch.nn.Module:
    return random_hf_model(config, seed=0)


@pytest.fixture(scope="module", params=sorted(_family_configs()))
def hf_family(request, tmp_path_factory):
    """(name, transformers model, directory written by its save_pretrained)."""
    model = _build_hf(_family_configs()[request.param])
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
def test_from_pretrained_logits_equal_transformers(hf_family, padded):
    name, hf_model, path = hf_family
    ours = MoETransformer.from_pretrained(path).eval()
    tokens, mask = _batch()
    mask = mask if padded else None
    expected, actual = _hf_logits(hf_model, tokens, mask), _ours_logits(ours, tokens, mask)
    real = torch.ones(BATCH, SEQ, dtype=torch.bool) if mask is None else mask.bool()
    assert_close_to_scale(actual[real], expected[real], LOGITS_TOL, f"{name} logits")


def test_save_pretrained_loads_in_transformers_and_round_trips_bitwise(hf_family, tmp_path):
    name, hf_model, path = hf_family
    ours = MoETransformer.from_pretrained(path)
    ours.save_pretrained(tmp_path)
    theirs_files, ours_files = _files(path), _files(tmp_path)
    assert sorted(ours_files) == sorted(theirs_files)
    for key, tensor in theirs_files.items():
        assert ours_files[key].dtype == tensor.dtype and torch.equal(ours_files[key], tensor), key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(hf_model)
    tokens, _ = _batch()
    assert_close_to_scale(_hf_logits(reloaded, tokens), _hf_logits(hf_model, tokens), LOGITS_TOL, name)
    again = MoETransformer.from_pretrained(tmp_path)
    assert again.config == ours.config
    for key, value in ours.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    # Token ids travel with the directory (the tokenizer's special tokens).
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (0, 2, 1)


def test_sharded_directories_both_ways(tmp_path):
    config = _family_configs()["deepseek_v3"]
    hf_model = _build_hf(config)
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = MoETransformer.from_pretrained(tmp_path / "hf")
    tokens, _ = _batch()
    expected = _hf_logits(hf_model, tokens)
    assert_close_to_scale(_ours_logits(ours, tokens), expected, LOGITS_TOL, "sharded load")
    ours.save_pretrained(tmp_path / "ours", max_shard_size="40KB")
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((tmp_path / "ours" / shard).exists() for shard in shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in _files(tmp_path / "ours").values())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert_close_to_scale(_hf_logits(reloaded, tokens), expected, LOGITS_TOL, "sharded save")


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_fused_in_memory_state_dict_loads_too(name, tmp_path):
    # A transformers 5 state dict written as is: experts fused ([E, 2F, H] gate_up_proj, [E, H, F]
    # down_proj), Mixtral's MoE block named "mlp".
    hf_model = _build_hf(_family_configs()[name])
    state = {key: value.contiguous() for key, value in hf_model.state_dict().items()}
    assert any(key.endswith("experts.gate_up_proj") for key in state)
    safetensors_torch.save_file(state, tmp_path / "model.safetensors")
    hf_model.config.save_pretrained(tmp_path)
    ours = MoETransformer.from_pretrained(tmp_path)
    tokens, _ = _batch()
    assert_close_to_scale(_ours_logits(ours, tokens), _hf_logits(hf_model, tokens), LOGITS_TOL, name)


def test_overrides_replace_training_settings(hf_family):
    _, _, path = hf_family
    ours = MoETransformer.from_pretrained(path, init_std=0.01, moe={"capacity_factor": 1.5})
    assert ours.config.init_std == 0.01 and ours.config.moe.capacity_factor == 1.5
    with pytest.raises(TypeError, match=r"Unknown MoETransformerConfig field\(s\) \['num_expert'\]"):
        MoETransformer.from_pretrained(path, num_expert=4)


def test_runtime_code_never_imports_transformers():
    import ast
    from pathlib import Path

    import lightning_moe

    package = Path(lightning_moe.__file__).parent
    offenders = []
    for file in package.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{file.relative_to(package)}: {n}" for n in names if n.split(".")[0] == "transformers"]
    assert not offenders, offenders


def test_bf16_checkpoint_keeps_every_dtype(tmp_path):
    # A bf16 DeepSeek-V3 with its router in fp32 (as transformers loads it, and the published
    # checkpoint's e_score_correction_bias): a mixed-dtype checkpoint.
    hf_model = _build_hf(_family_configs()["deepseek_v3"]).to(torch.bfloat16)
    for name, module in hf_model.named_modules():
        if name.endswith("mlp.gate"):
            module.float()
    hf_model.save_pretrained(tmp_path / "hf")
    theirs = _files(tmp_path / "hf")
    assert theirs["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert theirs["model.embed_tokens.weight"].dtype == torch.bfloat16
    ours = MoETransformer.from_pretrained(tmp_path / "hf")
    assert ours.embed.weight.dtype == torch.bfloat16
    assert ours.layers[1].ffn.router.weight.dtype == torch.float32
    assert ours.layers[1].ffn.experts.fc1_weight.dtype == torch.bfloat16
    assert all(p.requires_grad for p in ours.parameters())
    ours.save_pretrained(tmp_path / "ours")
    for key, tensor in _files(tmp_path / "ours").items():
        assert tensor.dtype == theirs[key].dtype and torch.equal(tensor, theirs[key]), key
    cast = MoETransformer.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert {p.dtype for p in cast.parameters()} == {torch.float32}
    assert cast.layers[1].ffn.router.expert_bias.dtype == torch.float32


def test_from_pretrained_maps_the_config(hf_family):
    name, hf_model, path = hf_family
    config = MoETransformer.from_pretrained(path).config
    hf_config = hf_model.config
    assert (config.vocab_size, config.hidden_size, config.num_layers) == (
        hf_config.vocab_size, hf_config.hidden_size, hf_config.num_hidden_layers,
    )
    expected_mode = {"qwen3_moe": "head", "mixtral": None, "olmoe": "full", "deepseek_v3": None, "qwen2_moe": None,
                     "glm4_moe": "head" if getattr(hf_config, "use_qk_norm", False) else None}
    assert config.qk_norm_mode == expected_mode[name.split("-")[0]]
    assert config.attention == ("mla" if name == "deepseek_v3" else "mha")
    assert config.tie_embeddings == hf_config.tie_word_embeddings
    # q/k/v biases: Qwen2-MoE's qkv_bias, GLM's attention_bias; partial rotary: GLM's rope parameters.
    assert config.attention_bias == bool(getattr(hf_config, "qkv_bias", getattr(hf_config, "attention_bias", False)))
    assert config.partial_rotary_factor == hf_config.rope_parameters.get("partial_rotary_factor", 1.0)
    if config.attention == "mha":
        rotary = int(config.attention_head_dim * config.partial_rotary_factor)
        assert config.rotary_dim == rotary and (name.split("-")[0] != "glm4_moe" or rotary < config.attention_head_dim)


# ------------------------------------------------------------------------------------ refusals


def _tiny_mixtral_dir(path) -> None:
    """A Mixtral directory written by our own save_pretrained (no transformers needed)."""
    config = MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=1, num_attention_heads=4, num_kv_heads=2, max_seq_len=64,
        rope_theta=1e6, norm_eps=1e-5, moe=MoEConfig(32, 16, 4, top_k=2),
    )
    MoETransformer(config).save_pretrained(path)


def _edit_config(path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


_DROP = object()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "llama"},
         r"model_type 'llama' is not supported.*deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe"),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 is not supported for Mixtral"),
        ({"sliding_window": 16}, r"sliding_window=16 .* not supported"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}},
         r"rope_type 'linear' is not supported.*default, yarn"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config .*fp8.* dequantize"),
        ({"attention_bias": True}, r"attention_bias=True is not supported"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported.*silu"),
        ({"router_jitter_noise": 0.1}, r"router_jitter_noise=0.1 is not supported"),
    ],
)
def test_unsupported_config_fields_are_refused_clearly(tmp_path, changes, message):
    _tiny_mixtral_dir(tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        MoETransformer.from_pretrained(tmp_path)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    _tiny_mixtral_dir(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = safetensors_torch.load_file(file)
    missing = tensors.pop("model.layers.0.block_sparse_moe.experts.3.w2.weight")
    safetensors_torch.save_file(tensors, file)
    with pytest.raises(KeyError, match=r"model.layers.0.block_sparse_moe.experts.3.w2.weight"):
        MoETransformer.from_pretrained(tmp_path)
    tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"] = missing
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    safetensors_torch.save_file(tensors, file)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.extra.weight"):
        MoETransformer.from_pretrained(tmp_path)


def test_no_weights_file_is_a_clear_error(tmp_path):
    _tiny_mixtral_dir(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model.safetensors.index.json or model.safetensors"):
        MoETransformer.from_pretrained(tmp_path)


def test_deepseek_group_scoring_other_than_top2_is_refused(tmp_path):
    config = _family_configs()["deepseek_v3"]
    config.num_experts_per_tok, config.topk_group = 6, 2  # HF scores groups by top 2, ours by 6 // 2
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"scores each expert group by its top 2 experts"):
        MoETransformer.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_mtp_layers_are_skipped_with_a_warning(name, tmp_path):
    hf_model = _build_hf(_family_configs()[name])
    hf_model.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = safetensors_torch.load_file(file)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)  # published MTP module layout
    tensors["model.layers.3.mlp.experts.0.up_proj.weight"] = torch.zeros(16, 32)
    safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})
    _edit_config(tmp_path, num_nextn_predict_layers=1)
    with pytest.warns(UserWarning, match=r"Skipped 2 tensor.*multi-token-prediction"):
        ours = MoETransformer.from_pretrained(tmp_path)
    tokens, _ = _batch()
    assert_close_to_scale(_ours_logits(ours, tokens), _hf_logits(hf_model, tokens), LOGITS_TOL, "mtp skipped")


def test_glm_partial_rotary_defaults_to_half_when_absent(tmp_path):
    # transformers' Glm4MoeConfig sets partial_rotary_factor 0.5 when config.json has none.
    config = _family_configs()["glm4_moe"]
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_parameters"].pop("partial_rotary_factor")
    raw.pop("partial_rotary_factor", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    from lightning_moe.models.hf import config_from_hf

    expected = transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters["partial_rotary_factor"]
    assert config_from_hf(raw)[0].partial_rotary_factor == expected == 0.5


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("glm4_moe", {"norm_topk_prob": False}, r"GLM-4.5 with norm_topk_prob=False .* not supported"),
        ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8}, r"sliding_window=8 .* not supported"),
    ],
)
def test_new_families_refuse_what_they_cannot_compute(name, changes, message, tmp_path):
    _family_configs()[name].save_pretrained(tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        MoETransformer.from_pretrained(tmp_path)


def test_infer_family_picks_the_first_family_holding_the_config():
    from lightning_moe.models.hf import infer_family

    base = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4, max_seq_len=64)
    plain = MoEConfig(32, 16, 4, top_k=2)
    gated = MoEConfig(32, 16, 4, top_k=2, shared_expert_ffn_hidden_size=16, shared_expert_gate=True)
    sigmoid = MoEConfig(32, 16, 4, top_k=2, score_func="sigmoid", expert_bias=True, shared_expert_ffn_hidden_size=16)
    assert infer_family(MoETransformerConfig(**base, moe=plain)) == "mixtral"
    assert infer_family(MoETransformerConfig(**base, moe=gated, attention_bias=True)) == "qwen2_moe"
    assert infer_family(MoETransformerConfig(**base, moe=sigmoid, partial_rotary_factor=0.5)) == "glm4_moe"
    assert infer_family(MoETransformerConfig(**base, moe=sigmoid, qk_norm=True)) == "glm4_moe"
    assert infer_family(MoETransformerConfig(**base, moe=plain, qk_norm=True)) == "qwen3_moe"


def test_save_pretrained_refuses_what_the_family_cannot_hold(tmp_path):
    config = MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=1, num_attention_heads=4, max_seq_len=64,
        moe=MoEConfig(32, 16, 4, top_k=2, shared_expert_ffn_hidden_size=16),
    )
    with pytest.raises(ValueError, match=r"mixtral has no shared expert"):
        MoETransformer(config).save_pretrained(tmp_path, family="mixtral")
    with pytest.raises(ValueError, match=r"Unknown family 'llama'"):
        MoETransformer(config).save_pretrained(tmp_path, family="llama")
    plain = dataclasses.replace(config, moe=MoEConfig(32, 16, 4, top_k=2), attention_bias=True, partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match=r"attention_bias=True: mixtral has no q/k/v biases; partial_rotary_factor=0.5: "
                                         r"mixtral rotates the whole head"):
        MoETransformer(plain).save_pretrained(tmp_path, family="mixtral")
    with pytest.raises(ValueError, match=r"every qwen2_moe MoE layer has a shared expert with a sigmoid gate"):
        MoETransformer(config).save_pretrained(tmp_path, family="qwen2_moe")
    with pytest.raises(ValueError, match=r"score_func='softmax' with top_k=2: glm4_moe renormalises sigmoid scores"):
        MoETransformer(config).save_pretrained(tmp_path, family="glm4_moe")


def test_missing_safetensors_names_the_extra(tmp_path, monkeypatch):
    _tiny_mixtral_dir(tmp_path)
    monkeypatch.setitem(__import__("sys").modules, "safetensors", None)
    monkeypatch.setitem(__import__("sys").modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[hf\]"'):
        MoETransformer.from_pretrained(tmp_path)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe"])
def test_gpt_oss_attention_is_refused_by_every_other_family(tmp_path, family):
    # transformers would drop the sinks and the o_proj bias with a warning and read the layers as full
    # attention (the window lives in config.json only): each must be refused by name, not written.
    from lightning_moe.models.hf import config_to_hf

    config = MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4, max_seq_len=64,
        moe=MoEConfig(32, 16, 4, top_k=2), attention_sinks=True, attention_out_bias=True, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )
    with pytest.raises(ValueError) as caught:
        config_to_hf(config, family, torch.float32)
    message = str(caught.value)
    for part in ("attention_sinks=True", "attention_out_bias=True", "sliding-window layers"):
        assert part in message, message
