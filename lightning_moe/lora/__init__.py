"""LoRA fine-tuning for MoE models: one adapter per expert, sharded with the experts.

``apply_lora(model, LoRAConfig(rank, alpha, ...))`` adds adapters to the routed experts (stacked
per expert, computed as grouped GEMMs over the experts' rows), the shared experts and named linear
layers, and freezes the rest; ``merge_lora(model)`` folds them back in. ``MoELanguageModel(lora=...)``
and the YAML ``model.lora`` apply them before parallelisation.
"""

from lightning_moe.lora.apply import (
    adapter_names,
    adapter_parameters,
    apply_lora,
    is_adapter_key,
    lora_modules,
    merge_lora,
)
from lightning_moe.lora.config import DEFAULT_TARGETS, LoRAConfig
from lightning_moe.lora.grouped import LoRAGroupedExperts, grouped_lora
from lightning_moe.lora.linear import LoRALinear

__all__ = [
    "DEFAULT_TARGETS", "LoRAConfig", "LoRAGroupedExperts", "LoRALinear", "adapter_names", "adapter_parameters",
    "apply_lora", "grouped_lora", "is_adapter_key", "lora_modules", "merge_lora",
]
