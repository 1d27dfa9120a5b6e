"""lightning_moe: Megatron-Core-class Mixture-of-Experts training for PyTorch Lightning.

The core (``layers``, ``parallel``, ...) never imports ``lightning``; the Lightning adapters live
in ``lightning_moe.strategies``, ``callbacks`` and ``plugins``.
"""

from lightning_moe.layers import (
    GroupedExperts,
    MoEConfig,
    MoELayer,
    SharedExpertMLP,
    TopKRouter,
    update_expert_bias,
)
from lightning_moe.models.hf.swap import swap_moe_blocks, unswap_moe_blocks

__all__ = [
    "GroupedExperts", "MoEConfig", "MoELayer", "SharedExpertMLP", "TopKRouter", "swap_moe_blocks", "unswap_moe_blocks",
    "update_expert_bias",
]
__version__ = "0.1.0.dev0"
