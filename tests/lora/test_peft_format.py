"""``export --adapter``'s format: our adapters, written for PEFT, give our LoRA model's logits there.

Oracle: PEFT itself. A tiny random ``transformers`` model of each family is written with its own
``save_pretrained``; ours is loaded from that directory, gets random adapters (B non-zero, so a
misplaced or transposed tensor shows) and is run; the adapters written by
:func:`~lightning_moe.lora.peft_format.peft_adapter` are then applied to the ``transformers`` model
by ``peft.PeftModel.from_pretrained`` and must give the same logits (fp32, 1e-5 of their scale).
Families: Mixtral, Qwen2-MoE (q/k/v biases, a shared expert left unadapted), DeepSeek-V3
(multi-head latent attention's projections), OLMoE and GLM-4.5 (partial rotary, q/k norm, biases);
Qwen3-MoE in ``test_lora_checkpoint.py``. GPT-OSS's experts are refused (transposed, interleaved).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.asserts import assert_close_to_scale
from helpers.hf import random_hf_model

from lightning_moe.lora import LoRAConfig, apply_lora, is_adapter_key
from lightning_moe.lora.peft_format import PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME, peft_adapter
from lightning_moe.models import MoETransformer

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
peft = pytest.importorskip("peft", reason="the test extra installs peft")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="the test extra installs safetensors")

VOCAB, TOL = 96, 1e-5
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj", "q_down_proj", "q_up_proj", "kv_up_proj"]


def _configs() -> dict:
    common = dict(vocab_size=VOCAB, hidden_size=32, max_position_embeddings=64, initializer_range=0.1)
    return {
        "mixtral": (transformers.MixtralConfig(
            **common, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=4, num_experts_per_tok=2), ["experts", *ATTENTION]),
        "qwen2_moe": (transformers.Qwen2MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
            num_experts_per_tok=2), ["experts", *ATTENTION]),
        "deepseek_v3": (transformers.DeepseekV3Config(
            **common, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=8, n_shared_experts=1), ["experts", *ATTENTION]),
        "olmoe": (transformers.OlmoeConfig(
            **common, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            num_experts=4, num_experts_per_tok=2), ["experts", *ATTENTION]),
        "glm4_moe": (transformers.Glm4MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
            n_shared_experts=1, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5),
            ["experts", *ATTENTION]),
    }


def _adapted(tmp_path, family: str, targets: list[str]):
    config, _ = _configs()[family]
    hf = random_hf_model(config)
    hf.save_pretrained(tmp_path / "base")
    ours = MoETransformer.from_pretrained(tmp_path / "base").eval()
    lora = LoRAConfig(rank=2, alpha=3.0, targets=targets)
    apply_lora(ours, lora)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if is_adapter_key(name):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    adapters = {k: v for k, v in ours.state_dict().items() if is_adapter_key(k)}
    return hf, ours, lora, adapters


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "olmoe", "glm4_moe"])
def test_peft_applies_our_adapters_with_our_logits(tmp_path, family):
    hf, ours, lora, adapters = _adapted(tmp_path, family, _configs()[family][1])
    adapter_config, tensors = peft_adapter(adapters, ours.config, lora, family, base=str(tmp_path / "base"))
    out = tmp_path / "adapter"
    out.mkdir()
    (out / PEFT_CONFIG_NAME).write_text(json.dumps(adapter_config))
    safetensors_torch.save_file(tensors, str(out / PEFT_WEIGHTS_NAME))
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, plain = ours(tokens), hf(input_ids=tokens).logits
        got = peft.PeftModel.from_pretrained(hf, out).eval()(input_ids=tokens).logits
    assert (want - plain).abs().max() > 0.1, "the adapters must change the logits for this test to mean anything"
    assert_close_to_scale(got, want, TOL, f"{family} logits with the adapters applied by PEFT")
    assert adapter_config["base_model_name_or_path"] == str(tmp_path / "base")
    assert adapter_config["r"] == 2 and adapter_config["lora_alpha"] == 3.0


def test_mlp_adapters_that_peft_would_put_on_the_experts_are_refused(tmp_path):
    # PEFT reads a deepseek_v3 model's target_modules named gate_proj/up_proj/down_proj as its experts.
    _, ours, lora, adapters = _adapted(tmp_path, "deepseek_v3", ["experts", "shared_expert", "q_up_proj"])
    with pytest.raises(ValueError, match=r"shared_expert\.fc1.*routed experts.*export --merge"):
        peft_adapter(adapters, ours.config, lora, "deepseek_v3")


def test_adapters_without_a_hugging_face_module_are_refused(tmp_path):
    _, ours, lora, adapters = _adapted(tmp_path, "mixtral", ["experts", "q_proj"])
    adapters["layers.0.attn.extra.lora_A"] = torch.zeros(2, 32)
    adapters["layers.0.attn.extra.lora_B"] = torch.zeros(32, 2)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.extra.*no 'mixtral' module"):
        peft_adapter(adapters, ours.config, lora, "mixtral")


def test_expert_adapters_of_gpt_oss_are_refused(tmp_path):
    # transformers stores GPT-OSS's experts transposed with gate/up columns interleaved: not mapped here.
    _, ours, lora, adapters = _adapted(tmp_path, "mixtral", ["experts"])
    with pytest.raises(ValueError, match=r"'gpt_oss'.*transposed.*export --merge"):
        peft_adapter(adapters, ours.config, lora, "gpt_oss")
