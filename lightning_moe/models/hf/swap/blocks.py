"""Replace ``transformers`` sparse-MoE blocks by `MoELayer` s holding the same weights, and back.

A swapped block's `MoELayer` sits where the block was (``model.layers.3.mlp``), so the decoder layer
calls it as it called the block: ``mlp(hidden [B, S, H]) -> [B, S, H]``. Its tensors are the block's
own (no copy; the router's weight as fp32, as every `MoELayer` keeps it), and it remembers the block's
class, config and dtypes in ``swapped_from`` for :func:`unswap_moe_blocks`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.expert_state import fc1_from_checkpoint
from lightning_moe.layers.moe import MoELayer
from lightning_moe.models.hf.config_map import moe_config_from_hf
from lightning_moe.models.hf.swap.families import BLOCK_FAMILIES, BlockFamily, block_family
from lightning_moe.models.hf.weights import Source, read_source

__all__ = ["SwappedBlock", "swap_moe_blocks", "unswap_moe_blocks"]

# Training losses are the user's choice (overrides): transformers adds its aux loss only with
# output_router_logits, computed over all layers at once, which no per-layer loss reproduces.
_NO_LOSSES = {"load_balancing": [], "aux_loss_coeff": 0.0}
_NEUTRAL_WHEN_ABSENT = ("gate.e_score_correction_bias",)
"""Block tensors whose zeros change nothing, written when the layer has none (``expert_bias=False``)."""
_SUPPORTED = ", ".join(f.class_name for f in BLOCK_FAMILIES)


@dataclass(frozen=True)
class SwappedBlock:
    """What :func:`unswap_moe_blocks` needs to rebuild the block a `MoELayer` replaced.

    Attributes:
        family: the block's :class:`~lightning_moe.models.hf.swap.families.BlockFamily`.
        block_class: the block's class.
        config: the ``transformers`` config the block was built from.
        dtypes: dtype of each of the block's state-dict tensors.
    """

    family: BlockFamily
    block_class: type
    config: Any
    dtypes: dict[str, torch.dtype]


def _from_transformers(module: nn.Module) -> bool:
    return any(cls.__module__.startswith("transformers.") for cls in type(module).__mro__)


def _find_blocks(model: nn.Module) -> tuple[list[tuple[str, nn.Module, BlockFamily]], list[str]]:
    """``(supported blocks as (name, module, family), names of unsupported MoE blocks with their class)``.

    An unsupported block is a ``transformers`` module (or a subclass of one) other than a
    supported class that owns a child named ``experts``, as every sparse-MoE block of
    ``transformers`` 5 does.
    """
    supported, inside = [], []
    unsupported: dict[str, list[str]] = {}  # class -> names of its blocks
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        family = block_family(type(module))
        if family is not None:
            supported.append((name, module, family))
            inside.append(name)
        elif not isinstance(module, MoELayer) and _from_transformers(module) and "experts" in module._modules:
            cls = type(module)
            unsupported.setdefault(f"{cls.__module__}.{cls.__qualname__}", []).append(name)
            inside.append(name)
    described = []
    for cls, names in unsupported.items():
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} blocks)" if len(names) > 3 else "")
        described.append(f"{cls} at {shown}")
    return supported, described


def _hf_config(model: nn.Module, name: str) -> Any:
    """The config of the innermost module around ``name`` that has a ``transformers`` config."""
    parts = name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        owner = model.get_submodule(".".join(parts[:depth]))
        config = getattr(owner, "config", None)
        if config is not None and callable(getattr(config, "to_dict", None)):
            return config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    raise ValueError(
        f"No transformers config found around the MoE block {name!r}: swap_moe_blocks reads the routing "
        "from the config of the transformers model holding the block. Pass the transformers model (or a "
        "module containing it) whose `config` describes the block."
    )


def _layer_config(hf_config: Any, family: BlockFamily, overrides: dict[str, Any]) -> MoEConfig:
    config = dataclasses.replace(moe_config_from_hf(hf_config.to_dict(), family.family), **_NO_LOSSES)
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(MoEConfig)})
    if unknown:
        raise TypeError(f"Unknown MoEConfig field(s) {unknown} in swap_moe_blocks overrides.")
    return dataclasses.replace(config, **overrides) if overrides else config


def _materialise_buffers(layer: nn.Module, device: torch.device) -> None:
    """Zeros on ``device`` for the buffers no checkpoint holds (the router's counters), left on meta."""
    for module in layer.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[key] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)


def _block_to_layer(block: nn.Module, family: BlockFamily, config: MoEConfig, hf_config: Any) -> MoELayer:
    tensors = block.state_dict()
    state = {key: read_source(source, tensors.__getitem__) for key, source in family.weights.items()}
    for key in ("router.weight", "router.expert_bias"):
        if key in state:
            state[key] = state[key].float()  # the router keeps fp32 weights and bias in any model dtype
    if config.expert_bias and "router.expert_bias" not in state:
        # An expert bias added by an override (a block without one) starts neutral.
        state["router.expert_bias"] = torch.zeros(config.num_experts, device=state["router.weight"].device)
    if not config.expert_bias:
        # DeepSeek-V3 without its score-correction bias (an override): only valid when it is zero.
        bias = state.pop("router.expert_bias", None)
        if bias is not None and bias.any():
            raise ValueError(
                f"expert_bias=False drops the non-zero e_score_correction_bias of {family.class_name}, which "
                "changes its routing; keep expert_bias=True."
            )
    with torch.device("meta"):
        layer = MoELayer(config)
    layer.load_state_dict(state, strict=True, assign=True)
    _materialise_buffers(layer, state["router.weight"].device)
    layer.swapped_from = SwappedBlock(family, type(block), hf_config, {k: t.dtype for k, t in tensors.items()})
    return layer


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def swap_moe_blocks(model: nn.Module, **overrides: Any) -> list[str]:
    """Replace, in place, every ``transformers`` sparse-MoE block of ``model`` by a `MoELayer` with the
    same weights and the same routing; returns the names of the replaced modules.

    Supported blocks (``transformers`` 5.x): Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 and GLM-4.5
    (:data:`~lightning_moe.models.hf.swap.families.BLOCK_FAMILIES`). The routing is read from the
    config of the ``transformers`` model around each block
    (:func:`~lightning_moe.models.hf.config_map.moe_config_from_hf`); a setting a `MoELayer` cannot
    reproduce exactly is refused with an error naming it, as is any other MoE block (all of them are
    named, and nothing is replaced). The `MoELayer` s take the blocks' tensors without copying, on
    their devices and in their dtypes (the router's weight in fp32), so fp32 logits are those of the
    original model. ``MoEStrategy`` then shards their experts, and the callbacks (load monitor,
    expert bias, recompute, offload) find them.

    Args:
        model: a ``transformers`` model, or a module containing one (a LightningModule).
        overrides: :class:`~lightning_moe.MoEConfig` fields for training, e.g. ``load_balancing=
            ["aux_loss"], aux_loss_coeff=1e-3`` or ``z_loss_coeff``. No loss by default, as
            ``transformers`` trains without ``output_router_logits``; with it (refused here: the
            swapped model records no router logits for it) ``transformers`` adds one aux loss over
            all layers' router logits at once, which no per-layer loss reproduces.

    Example::

        import transformers
        from lightning_moe import swap_moe_blocks, unswap_moe_blocks

        model = transformers.AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-30B-A3B")
        swap_moe_blocks(model, load_balancing=["aux_loss"], aux_loss_coeff=1e-3)
        # ... train it in a LightningModule under Trainer(strategy=MoEStrategy(expert_parallel_size=8)) ...
        unswap_moe_blocks(model)  # on one process holding the whole model
        model.save_pretrained("qwen3-finetuned")
    """
    supported, unsupported = _find_blocks(model)
    if unsupported:
        raise ValueError(
            f"swap_moe_blocks does not support the MoE block(s) {', '.join(unsupported)}. Supported blocks: "
            f"{_SUPPORTED}. Nothing was replaced."
        )
    if not supported:
        raise ValueError(
            f"No transformers sparse-MoE block found in {type(model).__name__}; supported blocks: {_SUPPORTED}."
        )
    # Build every layer before replacing any block, so an error leaves the model as it was.
    layers = []
    for name, block, family in supported:
        hf_config = _hf_config(model, name)
        if getattr(hf_config, "output_router_logits", False):
            # transformers' forward then reads the router logits its own routers record; a swapped
            # model has none and fails inside transformers' aux loss.
            raise ValueError(
                f"{type(hf_config).__name__}.output_router_logits=True: transformers' aux loss reads the router "
                "logits of its own MoE blocks, which a swapped model no longer has. Set "
                "model.config.output_router_logits = False and pass load_balancing=['aux_loss'], aux_loss_coeff=... "
                "to swap_moe_blocks for the MoELayer's own load-balancing loss."
            )
        layers.append((name, _block_to_layer(block, family, _layer_config(hf_config, family, overrides), hf_config)))
    for name, layer in layers:
        _replace(model, name, layer)
    return [name for name, _ in layers]


def _split_source(source: Source, value: Tensor) -> dict[str, Tensor]:
    """The block tensors that ``source`` reads, cut from ``value`` (the inverse of ``read_source``)."""
    if isinstance(source, str):
        return {source: value}
    if source[0] != "cat":
        raise ValueError(f"Unexpected weight source {source!r}.")
    parts = source[2]
    pieces = value.chunk(len(parts), dim=source[1])
    return {name: tensor for part, piece in zip(parts, pieces) for name, tensor in _split_source(part, piece).items()}


def _layer_to_block(name: str, layer: MoELayer) -> nn.Module:
    record: SwappedBlock = layer.swapped_from
    state = layer.state_dict()
    sharded = [key for key, value in state.items() if hasattr(value, "placements")]
    if sharded or layer.experts.num_experts != layer.config.num_experts:
        raise ValueError(
            f"{name} holds {layer.experts.num_experts} of its {layer.config.num_experts} experts (sharded across "
            "ranks): unswap_moe_blocks needs the whole layer on this process. Load the trained weights into a "
            "single-process copy of the swapped model first."
        )
    unmapped = sorted(set(state) - set(record.family.weights))
    if unmapped:
        raise ValueError(
            f"{name}: {unmapped} of the MoELayer have no place in transformers' {record.family.class_name}; "
            "only layers whose overrides keep the block's tensors can be written back."
        )
    tensors: dict[str, Tensor] = {}
    for key, value in state.items():
        if key == "experts.fc1_weight":
            value = fc1_from_checkpoint(value)  # [E, 2, F, H] -> gate_up_proj [E, 2F, H]
        tensors.update(_split_source(record.family.weights[key], value))
    tensors = {key: value.to(record.dtypes.get(key, value.dtype)) for key, value in tensors.items()}
    with torch.device("meta"):
        block = record.block_class(record.config)
    # transformers' DeepSeek-V3 block always has its score-correction bias: zeros when the layer had none.
    missing = {k: torch.zeros(t.shape, dtype=record.dtypes.get(k, t.dtype), device=state["router.weight"].device)
               for k, t in block.state_dict().items() if k not in tensors and k in _NEUTRAL_WHEN_ABSENT}
    block.load_state_dict({**tensors, **missing}, strict=True, assign=True)
    return block


def unswap_moe_blocks(model: nn.Module) -> list[str]:
    """Put back, in place, the ``transformers`` block of every `MoELayer` made by :func:`swap_moe_blocks`,
    holding the layer's current weights; returns the names of the restored modules.

    Afterwards the model is the ``transformers`` model again: its ``save_pretrained`` writes a
    directory its class's ``from_pretrained`` loads. The layers must hold all their experts (one
    process; an expert-parallel model's trained state is loaded into a single-process copy first),
    and their weights must fit the block (an ``expert_bias`` added by an override has no place in a
    block without one: refused). The router's weight gets back the block's dtype.
    """
    swapped = [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer) and hasattr(m, "swapped_from")]
    if not swapped:
        raise ValueError(f"{type(model).__name__} has no MoELayer made by swap_moe_blocks to put back.")
    blocks = [(name, _layer_to_block(name, layer)) for name, layer in swapped]
    for name, block in blocks:
        _replace(model, name, block)
    return [name for name, _ in blocks]
