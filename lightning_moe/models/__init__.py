"""The reference Mixture-of-Experts language model: plain single-device ``nn.Module`` s.

No Lightning and no ``torch.distributed`` here (docs/architecture.md §1); examples, benchmarks, tests
and the LightningModule in ``lightning_moe.lit`` build on it, and ``lightning_moe.parallel``
parallelises it afterwards. Presets of published models are in ``examples/configs/models/``.
"""

from lightning_moe.models.attention import Attention, RMSNorm, apply_rotary, rotary_cos_sin
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.transformer import (
    DenseMLP,
    MoETransformer,
    TransformerBlock,
    init_generator,
    module_seed,
)

__all__ = [
    "Attention",
    "DenseMLP",
    "MoETransformer",
    "MoETransformerConfig",
    "RMSNorm",
    "TransformerBlock",
    "apply_rotary",
    "init_generator",
    "module_seed",
    "rotary_cos_sin",
]
