"""The reference Mixture-of-Experts language model: plain single-device ``nn.Module`` s.

No Lightning and no ``torch.distributed`` here (docs/architecture.md §1); examples, benchmarks, tests
and the LightningModule in ``lightning_moe.lit`` build on it, and ``lightning_moe.parallel``
parallelises it afterwards. Presets of published models are in ``examples/configs/models/``;
Hugging Face model directories load and save with ``MoETransformer.from_pretrained`` /
``save_pretrained`` (:mod:`lightning_moe.models.hf`: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE,
DeepSeek-V3 / Kimi K2 with multi-head latent attention, GLM-4.5, GPT-OSS).
"""

from lightning_moe.models.attention import Attention, CoreAttention, RMSNorm
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.mla import MultiLatentAttention
from lightning_moe.models.rope import RopeScaling, apply_rotary, rotary_cos_sin
from lightning_moe.models.transformer import (
    DenseMLP,
    MoETransformer,
    TransformerBlock,
    init_generator,
    module_seed,
)

__all__ = [
    "Attention",
    "CoreAttention",
    "DenseMLP",
    "MoETransformer",
    "MoETransformerConfig",
    "MultiLatentAttention",
    "RMSNorm",
    "RopeScaling",
    "TransformerBlock",
    "apply_rotary",
    "init_generator",
    "module_seed",
    "rotary_cos_sin",
]
