"""Tiny random ``transformers`` models of every family :func:`lightning_moe.swap_moe_blocks` supports.

Built from configs (no download), fp32, with the norms and DeepSeek-V3's score-correction bias
moved away from their initial values, so a tensor put in the wrong place shows in the logits.
"""

from __future__ import annotations

import torch

from helpers.hf import random_hf_model

__all__ = ["SWAP_FAMILIES", "tiny_moe_config", "tiny_moe_model"]

SWAP_FAMILIES = ("deepseek_v3", "glm4_moe", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe")
VOCAB = 96


def tiny_moe_config(family: str, **changes):
    """A two-layer ``transformers`` config of ``family`` with 4 or 8 experts; ``changes`` replace keys."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, max_position_embeddings=64, initializer_range=0.1,
                  bos_token_id=0, eos_token_id=2, pad_token_id=1, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    configs = {
        "mixtral": lambda: transformers.MixtralConfig(
            **common, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
        # Softmax over all experts without renormalising the top-k; a sigmoid-gated shared expert.
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
        # Renormalised top-k; the second layer dense (mlp_only_layers).
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
            norm_topk_prob=True, mlp_only_layers=[1]),
        "olmoe": lambda: transformers.OlmoeConfig(
            **common, intermediate_size=16, num_experts=8, num_experts_per_tok=2),
        # Sigmoid scores, score-correction bias, 2 of 4 groups, scaling, two shared experts, one dense layer first.
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **{**common, "num_hidden_layers": 3, "num_key_value_heads": 4}, intermediate_size=48,
            moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
            first_k_dense_replace=1, n_shared_experts=2, routed_scaling_factor=2.5, kv_lora_rank=16,
            q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12),
        # DeepSeek-V3's router (2 of 4 groups, scaling), one shared expert, one dense layer first.
        "glm4_moe": lambda: transformers.Glm4MoeConfig(
            **{**common, "num_hidden_layers": 3}, intermediate_size=48, moe_intermediate_size=16,
            n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
            n_shared_experts=1, routed_scaling_factor=1.5, use_qk_norm=True, num_mtp_layers=0),
    }
    config = configs[family]()
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def tiny_moe_model(family: str, seed: int = 0, **changes) -> torch.nn.Module:
    """The causal LM of :func:`tiny_moe_config`, random (``seed``), in eval mode."""
    return random_hf_model(tiny_moe_config(family, **changes), seed)
