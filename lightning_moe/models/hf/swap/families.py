"""The ``transformers`` sparse-MoE blocks that :func:`~lightning_moe.swap_moe_blocks` replaces, one entry per family.

The entries are built from the family registry (:mod:`lightning_moe.models.hf.families`, each
family's ``block_class`` and ``block_weights``). Each :class:`BlockFamily` names the block's class (``transformers`` 5.x, matched by module and
name, so nothing here imports ``transformers``) and where every tensor of the equivalent
:class:`~lightning_moe.MoELayer` lies in the block's own state dict. The routing of each family
(softmax before or after top-k, ``norm_topk_prob``, DeepSeek-V3's sigmoid scores, correction bias,
groups and scaling, the shared experts) is mapped from the model's config by
:func:`~lightning_moe.models.hf.config_map.moe_config_from_hf`, the same mapping
``MoETransformer.from_pretrained`` uses.

In memory ``transformers`` 5 keeps the routed experts fused: ``experts.gate_up_proj``
``[E, 2F, H]`` (per expert the ``F`` gate rows, then the ``F`` up rows) and
``experts.down_proj`` ``[E, H, F]``, which is exactly how `GroupedExperts` stores ``fc1_weight``
and ``fc2_weight`` (:mod:`lightning_moe.models.hf.weights`), so the experts move as they are.
Sources use :data:`~lightning_moe.models.hf.weights.Source`'s notation: a name, or
``("cat", dim, [names])`` for the shared expert's fc1 (its gate rows, then its up rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from lightning_moe.models.hf.registry import FAMILIES
from lightning_moe.models.hf.weights import Source

__all__ = ["BLOCK_FAMILIES", "BlockFamily", "block_family"]


@dataclass(frozen=True)
class BlockFamily:
    """One ``transformers`` sparse-MoE block class and how its tensors map to a `MoELayer`'s.

    Attributes:
        family: the ``model_type`` (the family name of :mod:`~lightning_moe.models.hf.config_map`).
        module: the module defining the block class, e.g. ``transformers.models.mixtral.modeling_mixtral``.
        class_name: the block class, e.g. ``MixtralSparseMoeBlock``.
        weights: `MoELayer` state-dict key -> where it lies in the block's state dict.
    """

    family: str
    module: str
    class_name: str
    weights: Mapping[str, Source]

    @property
    def qualified_name(self) -> str:
        """``module.class_name``, how errors name the block."""
        return f"{self.module}.{self.class_name}"


# Router and routed experts: the same names in every family.
_ROUTED = {
    "router.weight": "gate.weight",
    "experts.fc1_weight": "experts.gate_up_proj",
    "experts.fc2_weight": "experts.down_proj",
}


def _block(family: str, class_name: str, extra: Mapping[str, Source]) -> BlockFamily:
    module = f"transformers.models.{family}.modeling_{family}"
    return BlockFamily(family, module, class_name, MappingProxyType({**_ROUTED, **extra}))


BLOCK_FAMILIES: tuple[BlockFamily, ...] = tuple(
    _block(spec.name, spec.block_class, spec.block_weights) for spec in FAMILIES.values() if spec.block_class
)
"""Every supported block, in the order errors list them (the registry's order)."""

_BY_CLASS = MappingProxyType({(f.module, f.class_name): f for f in BLOCK_FAMILIES})


def block_family(module_class: type) -> BlockFamily | None:
    """The family of a block of exactly ``module_class`` (a subclass may compute something else), or None."""
    return _BY_CLASS.get((module_class.__module__, module_class.__name__))
