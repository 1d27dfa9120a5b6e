"""The Hugging Face family registry: one :class:`Family` per ``model_type``, registered by its own file.

A family is everything that differs between, say, Mixtral and DeepSeek-V3 when their
``config.json`` and safetensors are read or written: the ``transformers`` class, the defaults of
keys a published ``config.json`` may omit, the key holding the expert count, how the MoE block and
the whole model are configured, what the family's ``transformers`` code does that this model
cannot reproduce, how a config is written back, the tensor names that are not shared, and the
sparse-MoE block class :func:`~lightning_moe.swap_moe_blocks` replaces. The shared machinery
(:mod:`.config_map`, :mod:`.config_export`, :mod:`.weights`, :mod:`.swap`) reads these fields and
holds no ``if family == ...``.

Each file of :mod:`lightning_moe.models.hf.families` builds its :class:`Family` and calls
:func:`register_family`; importing that package registers the built-in ones. Adding a family is
one new file there, its preset and its test.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: these modules read the registry
    from torch import Tensor

    from lightning_moe.layers.config import MoEConfig
    from lightning_moe.models.config import MoETransformerConfig
    from lightning_moe.models.hf.fields import Fields
    from lightning_moe.models.hf.weights import Source

__all__ = ["FAMILIES", "Family", "family", "model_families", "moe_families", "register_family"]


def _accept(fields: Fields) -> None:
    """No family-specific refusal."""


@dataclass(frozen=True)
class Family:
    """One Hugging Face family (a ``model_type``) and everything about it that is not shared.

    Attributes:
        name: the ``model_type`` of ``config.json``, e.g. ``"mixtral"``.
        title: how people write it, e.g. ``"Mixtral"`` (errors list it).
        defaults: ``transformers``' defaults of the keys this family's mapping reads that a
            published ``config.json`` may omit (the keys every family shares are in :mod:`.fields`).
        expert_count_keys: the keys that may hold the number of routed experts, first present wins.
        moe_config: the :class:`MoEConfig` of the family's sparse-MoE block from its ``config.json``.
        refuse_moe: raises ``ValueError`` for what the family's MoE block does that a `MoELayer`
            cannot reproduce (beyond the checks every family shares).
        architecture: the ``transformers`` class loading a whole model, e.g.
            ``"MixtralForCausalLM"``; None for a family whose MoE blocks alone are mapped
            (:func:`~lightning_moe.swap_moe_blocks`, no ``from_pretrained``).
        model_config: the whole :class:`MoETransformerConfig` from the fields and the keyword
            arguments every family shares (vocabulary, sizes, rope, norms); whole-model families only.
        refuse_model: as ``refuse_moe``, for the rest of the model (sliding windows, q/k/v clipping...).
        attention: ``"mha"`` or ``"mla"``, the attention this family's ``transformers`` code computes.
        qk_norm: the q/k normalisation (``MoETransformerConfig.qk_norm_mode``: ``None``, ``"head"``
            or ``"full"``); with ``attention`` it is how :func:`~lightning_moe.models.hf.infer_family`
            recognises a config.
        interleaved_rope: whether rotary embeddings may rotate interleaved pairs (else halves).
        optional_qk_norm: whether the family's ``config.json`` can also turn its ``qk_norm`` off
            (GLM-4.5's ``use_qk_norm``).
        attention_bias_key: the ``config.json`` key switching q/k/v biases on (``"attention_bias"``
            for GLM-4.5, ``"qkv_bias"`` for Qwen2-MoE); None: the family has none, and a set
            ``attention_bias`` is refused.
        partial_rotary: whether rotary embeddings may cover only part of each head
            (``partial_rotary_factor`` < 1, GLM-4.5); else such a factor is refused.
        shared_expert_gate: whether the family's shared expert is scaled by a sigmoid gate
            (Qwen2-MoE); else a gated shared expert cannot be written as this family.
        export_problems: what of a :class:`MoETransformerConfig` this family cannot hold, one
            phrase each (empty: it can), after the checks every family shares.
        export_fields: the family's own ``config.json`` keys for a config that passed the checks.
        moe_prefix: the MoE block's module name in a decoder layer's tensor names.
        expert_names: the (gate, up, down) projection names of one expert on disk.
        weight_defaults: ``(names written, config) -> tensors`` the family always has that a model
            without them writes as their neutral value.
        model_type_aliases: other ``model_type`` s of ``config.json`` files this family reads as its
            own (Kimi K2's ``kimi_k2``, whose custom code is DeepSeek-V3's); writing uses ``name``.
        trailing_layers: ``(what the decoder layers past num_layers hold, why they are skipped)``
            for a family whose checkpoints carry such layers (loading skips them with a warning);
            None: such tensors are an error like any other unknown one.
        block_class: the sparse-MoE block class in
            ``transformers.models.{name}.modeling_{name}``; None: no block swap.
        block_weights: where the block's tensors lie beyond the router and routed experts every
            family shares (:mod:`lightning_moe.models.hf.swap.families`).
        moe_sources: ``(layer's MoE prefix, config) -> {our key under ffn.: Source}`` for a family
            whose MoE block is not laid out as the shared mapping of :mod:`.weights` expects
            (GPT-OSS); written back by inverting the sources. None: the shared mapping.
        expert_activation: the activation of the family's experts (``MoEConfig.activation``).
        expert_biases: whether the family's router and experts have biases (``router_bias``,
            ``fc1_bias``, ``fc2_bias``); exporting them to a family without is refused.
        gpt_oss_attention: whether the family's attention has GPT-OSS's pieces: per-head sinks
            (``attention_sinks``), an ``o_proj`` bias (``attention_out_bias``) and sliding-window layers
            written as ``layer_types`` / ``sliding_window``; every other family refuses them on export.
    """

    name: str
    title: str
    defaults: Mapping[str, Any]
    expert_count_keys: tuple[str, ...]
    moe_config: Callable[[Fields], MoEConfig]
    refuse_moe: Callable[[Fields], None] = _accept
    architecture: str | None = None
    model_config: Callable[[Fields, dict[str, Any]], MoETransformerConfig] | None = None
    refuse_model: Callable[[Fields], None] = _accept
    attention: str = "mha"
    qk_norm: str | None = None
    interleaved_rope: bool = False
    optional_qk_norm: bool = False
    attention_bias_key: str | None = None
    partial_rotary: bool = False
    shared_expert_gate: bool = False
    export_problems: Callable[[MoETransformerConfig], list[str]] | None = None
    export_fields: Callable[[MoETransformerConfig], dict[str, Any]] | None = None
    moe_prefix: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    weight_defaults: Callable[[set[str], MoETransformerConfig], dict[str, Tensor]] | None = None
    trailing_layers: tuple[str, str] | None = None
    model_type_aliases: tuple[str, ...] = ()
    block_class: str | None = None
    block_weights: Mapping[str, Source] = field(default_factory=dict)
    moe_sources: Callable[[str, MoETransformerConfig], dict[str, Source]] | None = None
    expert_activation: str = "swiglu"
    expert_biases: bool = False
    gpt_oss_attention: bool = False

    @property
    def whole_model(self) -> bool:
        """Whether whole models of this family load and save (``from_pretrained`` / ``save_pretrained``)."""
        return self.architecture is not None

    def computes_qk_norm(self, mode: str | None) -> bool:
        """Whether this family's attention can apply the q/k norm ``mode`` (None, ``"head"``, ``"full"``)."""
        return mode == self.qk_norm or (self.optional_qk_norm and mode is None)


_REGISTRY: dict[str, Family] = {}
FAMILIES: Mapping[str, Family] = MappingProxyType(_REGISTRY)
"""Every registered family by name, in registration order (read-only; :func:`register_family` adds)."""


def register_family(spec: Family) -> Family:
    """Add ``spec`` to :data:`FAMILIES` and return it; refuses a second family of the same name
    and a whole-model family missing one of its whole-model mappings."""
    if spec.name in _REGISTRY:
        raise ValueError(f"A Hugging Face family named {spec.name!r} is already registered.")
    if spec.whole_model:
        missing = [name for name in ("model_config", "export_problems", "export_fields") if getattr(spec, name) is None]
        if missing:
            raise ValueError(
                f"Family {spec.name!r} names architecture={spec.architecture!r} but has no {', '.join(missing)}: "
                "a whole-model family maps config.json both ways; give them or set architecture=None."
            )
    _REGISTRY[spec.name] = spec
    return spec


def family(name: str) -> Family:
    """The registered family ``name``, or a ``ValueError`` listing the registered ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"Unknown Hugging Face family {name!r}; registered families: {', '.join(sorted(_REGISTRY))}."
        ) from None


def model_families() -> tuple[str, ...]:
    """The names of the families whose whole models load and save, sorted."""
    return tuple(sorted(name for name, spec in _REGISTRY.items() if spec.whole_model))


def moe_families() -> tuple[str, ...]:
    """The names of every family whose sparse-MoE block is mapped, sorted."""
    return tuple(sorted(_REGISTRY))
