"""Write a tiny Hugging Face MoE model directory (random weights, nothing downloaded), to fine-tune.

    python examples/make_tiny_hf_model.py tiny_qwen3_moe            # Qwen3-MoE, 8 experts
    python examples/make_tiny_hf_model.py tiny_ds --family deepseek_v3
    python examples/make_tiny_hf_model.py tiny_glm --family glm4_moe   # also qwen2_moe
    lightning-moe fit --config examples/configs/hf_finetune_tiny.yaml

The directory is what ``transformers``' ``save_pretrained`` writes (``config.json``, safetensors
weights) plus a ``tokenizer.json``: a byte-level BPE tokenizer trained here with the ``tokenizers``
library on the Python standard library's sources (the corpus the example trains on), so the model
trains on its own vocabulary. Needs ``transformers`` and ``tokenizers`` (``pip install -e
".[test]"``); stands in for a published checkpoint such as ``Qwen/Qwen3-30B-A3B``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

VOCAB_SIZE = 320
"""256 byte tokens, 3 special tokens, 61 merges; a multiple of 64 (tensor parallelism)."""
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
FAMILIES = ("qwen3_moe", "deepseek_v3", "qwen2_moe", "glm4_moe")
"""The families :func:`tiny_config` makes."""


def tiny_config(family: str = "qwen3_moe", vocab_size: int = VOCAB_SIZE):
    """A small ``transformers`` config of ``family`` (one of :data:`FAMILIES`) that every 4-rank
    layout of the tests shards (heads, vocabulary and experts divide by 2 and 4)."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=32, max_position_embeddings=128, initializer_range=0.1,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        )
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **common, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=16,
            q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, num_mtp_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        )
    if family == "qwen2_moe":  # q/k/v biases, a sigmoid-gated shared expert, a dense layer
        return transformers.Qwen2MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
            mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        )
    if family == "glm4_moe":  # partial rotary, q/k norm, q/k/v biases, DeepSeek-V3's router
        return transformers.Glm4MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
            n_shared_experts=1, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
            partial_rotary_factor=0.5, num_mtp_layers=0, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        )
    raise ValueError(f"Unknown family {family!r}; choose one of {', '.join(FAMILIES)}.")


def tiny_model(family: str = "qwen3_moe", seed: int = 0) -> torch.nn.Module:
    """The ``transformers`` model of :func:`tiny_config`, random; norms and the DeepSeek score bias
    moved away from their initial values, so a weight loaded into the wrong place shows."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))
    return model


def train_tokenizer(texts, vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` ids trained on ``texts``; the
    special tokens ``<pad>``, ``<bos>``, ``<eos>`` are ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def stdlib_texts(max_files: int = 40) -> list[str]:
    """The first standard-library sources of ``lightning_moe.data.stdlib_corpus`` (the example's corpus)."""
    from lightning_moe.data import stdlib_corpus

    return [path.read_text(encoding="utf-8", errors="replace") for path in stdlib_corpus(max_files)]


def make_tiny_model(path: str | Path, family: str = "qwen3_moe", seed: int = 0, texts=None) -> torch.nn.Module:
    """Write the tiny ``family`` model and its ``tokenizer.json`` (trained on ``texts``, default
    :func:`stdlib_texts`) into the directory ``path``; return the ``transformers`` model."""
    model = tiny_model(family, seed)
    path = Path(path)
    model.save_pretrained(path)
    train_tokenizer(stdlib_texts() if texts is None else texts).save(str(path / "tokenizer.json"))
    return model


def main(argv: list[str] | None = None) -> None:
    """Command line: ``make_tiny_hf_model.py OUT [--family F] [--seed N]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="the directory to write")
    parser.add_argument("--family", default="qwen3_moe", choices=list(FAMILIES))
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    make_tiny_model(options.output, options.family, options.seed)
    print(f"Wrote a tiny {options.family} model and its tokenizer.json to {options.output}")


if __name__ == "__main__":
    main(sys.argv[1:])
