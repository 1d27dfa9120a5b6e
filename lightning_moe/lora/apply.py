"""`apply_lora` and `merge_lora`: put adapters on a model's targets, fold them back in.

Applied to the model built for one device, before parallelisation (``MoEStrategy`` and
:func:`~lightning_moe.parallel.parallelize` then shard the adapters with their layers: the
experts' adapters over EP / ETP / EDP, the attention projections' over TP). Every parameter of
the model except the adapters is frozen (``requires_grad=False``), as PEFT does.
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch
from torch import nn

from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.layers.shared_expert import SharedExpertMLP
from lightning_moe.lora.config import EXPERTS, SHARED_EXPERT, LoRAConfig
from lightning_moe.lora.grouped import ADAPTER_NAMES, LoRAGroupedExperts
from lightning_moe.lora.linear import LoRALinear, name_seed

__all__ = ["adapter_names", "adapter_parameters", "apply_lora", "is_adapter_key", "lora_modules", "merge_lora"]

_LINEAR_ADAPTERS = ("lora_A", "lora_B")


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key (or parameter name) is an adapter's."""
    return key.rsplit(".", 1)[-1] in (*_LINEAR_ADAPTERS, *ADAPTER_NAMES)


def adapter_names(model: nn.Module) -> list[str]:
    """Names of the adapter parameters of ``model``."""
    return [name for name, _ in model.named_parameters() if is_adapter_key(name)]


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters of ``model`` (what an optimizer trains)."""
    return [param for name, param in model.named_parameters() if is_adapter_key(name)]


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The adapted modules of ``model`` by name (``LoRALinear`` and ``LoRAGroupedExperts``)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAGroupedExperts))}


def _matches(name: str, pattern: str) -> bool:
    return fnmatch(name, pattern) or fnmatch(name.rsplit(".", 1)[-1], pattern)


def _targets(model: nn.Module, config: LoRAConfig) -> tuple[list[tuple[str, GroupedExperts]], list[tuple[str, nn.Linear]]]:
    """The routed experts and the linear layers ``config.targets`` names."""
    patterns = [t for t in config.targets if t not in (EXPERTS, SHARED_EXPERT)]
    experts, linears, seen = [], [], set()
    for name, module in model.named_modules():
        if EXPERTS in config.targets and type(module) is GroupedExperts:
            experts.append((name, module))
        if SHARED_EXPERT in config.targets and isinstance(module, SharedExpertMLP):
            for child in ("fc1", "fc2"):
                linears.append((f"{name}.{child}", getattr(module, child)))
                seen.add(f"{name}.{child}")
        if type(module) is nn.Linear and name not in seen and any(_matches(name, p) for p in patterns):
            linears.append((name, module))
    return experts, linears


def apply_lora(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """Add LoRA adapters to ``model``'s targets in place, freeze everything else, return ``model``.

    Routed experts (``GroupedExperts``) become :class:`~lightning_moe.lora.grouped.LoRAGroupedExperts`
    (one adapter per expert, stacked), linear layers :class:`~lightning_moe.lora.linear.LoRALinear`.
    The model computes exactly what it did until the adapters are trained (``B`` is zero).
    Call it on the one-device model (meta-device parameters are fine: the adapters are drawn when
    the model is materialised), before any parallelisation.

    Raises:
        ValueError: nothing in ``model`` matches ``config.targets``.
        RuntimeError: ``model`` is already parallelised or already has adapters.
    """
    if lora_modules(model):
        raise RuntimeError("apply_lora: this model already has LoRA adapters; apply it once.")
    experts, linears = _targets(model, config)
    if not experts and not linears:
        linear_names = [n for n, m in model.named_modules() if type(m) is nn.Linear][:8]
        raise ValueError(
            f"LoRAConfig.targets={config.targets} matches nothing in {type(model).__name__}: it has "
            f"{'no' if not any(type(m) is GroupedExperts for m in model.modules()) else 'some'} routed experts "
            f"and linear layers such as {linear_names}. Name 'experts', 'shared_expert' or patterns of those names."
        )
    dtype = config.torch_base_dtype
    for name, module in experts:
        LoRAGroupedExperts.convert(module, config.rank, config.scale, config.dropout, name_seed(config.seed, name))
        if dtype is not None:
            for param in (module.fc1_weight, module.fc2_weight):
                param.data = param.data.to(dtype)
    for name, module in linears:
        LoRALinear.convert(module, config.rank, config.scale, config.dropout, name_seed(config.seed, name))
        if dtype is not None:
            module.weight.data = module.weight.data.to(dtype)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_key(name))
    return model


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter of ``model`` into its base weight and return the plain model, in place.

    ``LoRALinear`` becomes ``nn.Linear`` and ``LoRAGroupedExperts`` ``GroupedExperts`` again, with
    ``W + alpha/r * B @ A`` (computed in fp32, stored in the base weight's dtype) and the state-dict
    keys of the model before :func:`apply_lora`. The same logits up to rounding. ``requires_grad``
    of the merged weights is left as it was (frozen); a one-device model or one sharded over EP /
    ETP only (each shard merges its block). Models without adapters are returned unchanged.
    """
    for module in lora_modules(model).values():
        if isinstance(module, LoRALinear):
            module.weight.data = module.merged_weight()
            del module.lora_A, module.lora_B
            module.__class__ = nn.Linear
        else:
            fc1, fc2 = module.merged_weights()
            module.fc1_weight.data, module.fc2_weight.data = fc1, fc2
            for name in ADAPTER_NAMES:
                delattr(module, name)
            module._param_tags = {k: v for k, v in module._param_tags.items() if k not in ADAPTER_NAMES}
            module.__class__ = GroupedExperts
    return model
