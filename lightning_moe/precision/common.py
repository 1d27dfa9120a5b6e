"""What both FP8 backends share: recipe names, expert token alignment, which modules stay high precision.

* Recipes. ``torch`` backend (:mod:`~lightning_moe.precision.torch_fp8`): ``rowwise`` (default)
  and ``tensorwise`` dynamic scaling. ``te`` backend (:mod:`~lightning_moe.precision.te_fp8`):
  ``delayed`` (TE ``DelayedScaling``), ``tensorwise`` (``Float8CurrentScaling``), ``blockwise``
  (``Float8BlockScaling``, 1x128 / 128x128 blocks), ``mxfp8`` (``MXFP8BlockScaling``, Blackwell)
  and ``nvfp4`` (``NVFP4BlockScaling``, FP4), where the installed TE has them.
* Expert token alignment (docs/numerics.md §12, Megatron ``get_fp8_align_size`` /
  ``get_fp4_align_size``): quantised grouped GEMMs need every expert's token segment to be a
  multiple of 16 rows (FP8), 32 (MXFP8) or 128 (NVFP4). The MoE layer pads its routing map to
  that multiple with zero-probability filler rows when ``MoEConfig.router_padding_alignment`` is
  set (``layers.permute.pad_routing_map``); :func:`apply_token_alignment` sets it.
* High precision: routers are never converted (they compute in ``router_dtype``, fp32 by default,
  and keep fp32 weights), neither is the output head (``*lm_head`` by default), nor any layer whose
  shapes the FP8 GEMMs cannot take (dimensions not multiples of 16); with ``first_last_bf16`` the
  first and last transformer layers stay in high precision too (Megatron
  ``first_last_layers_bf16``, ``num_layers_at_start_in_bf16`` / ``num_layers_at_end_in_bf16``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from lightning_moe.layers.moe import MoELayer

__all__ = [
    "TE_RECIPES",
    "TORCH_RECIPES",
    "ConversionReport",
    "aligned_size",
    "apply_token_alignment",
    "high_precision_prefixes",
    "is_dtensor",
    "skip_reason",
    "token_alignment",
]

TORCH_RECIPES = ("rowwise", "tensorwise")
"""Recipe names of the ``torch`` backend."""
TE_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4")
"""Recipe names of the ``te`` backend (each where the installed Transformer Engine has it)."""

_TOKEN_ALIGNMENT = {"rowwise": 16, "tensorwise": 16, "delayed": 16, "blockwise": 16, "mxfp8": 32, "nvfp4": 128}
_TE_CLASS_RECIPE = {
    "DelayedScaling": "delayed",
    "Float8CurrentScaling": "tensorwise",
    "Float8BlockScaling": "blockwise",
    "MXFP8BlockScaling": "mxfp8",
    "NVFP4BlockScaling": "nvfp4",
}


def token_alignment(recipe: object) -> int:
    """Rows each expert segment must be a multiple of for ``recipe`` (a name or a TE recipe object)."""
    name = recipe if isinstance(recipe, str) else _TE_CLASS_RECIPE.get(type(recipe).__name__, "delayed")
    if name not in _TOKEN_ALIGNMENT:
        raise ValueError(f"Unknown FP8 recipe {name!r}; choose from {sorted(_TOKEN_ALIGNMENT)}.")
    return _TOKEN_ALIGNMENT[name]


def aligned_size(count: int, alignment: int) -> int:
    """``count`` rounded up to a multiple of ``alignment`` (0 stays 0: empty experts are not padded)."""
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}.")
    return -(-count // alignment) * alignment


def apply_token_alignment(model: nn.Module, alignment: int) -> list[str]:
    """Set ``router_padding_alignment`` of every dropless MoE layer of ``model`` to ``alignment``.

    Layers that already pad to a multiple of ``alignment`` are kept; drop-and-pad layers are left
    alone (their static capacity is used as is; segments that are not a multiple of 16 take the
    per-expert FP8 path). Returns the names of the layers changed. Raises ``ValueError`` when a
    layer's alignment is set to a value that is not a multiple of ``alignment``.

    The ``MoEConfig`` object is changed in place, so layers that share it change together.
    """
    changed, set_here = [], set()
    for name, layer in model.named_modules():
        if not isinstance(layer, MoELayer) or layer.config.pad_to_capacity:
            continue
        current = layer.config.router_padding_alignment
        if current is None or id(layer.config) in set_here:
            layer.config.router_padding_alignment = alignment
            set_here.add(id(layer.config))
            changed.append(name)
        elif current % alignment:
            raise ValueError(
                f"{name}: MoEConfig.router_padding_alignment={current} is not a multiple of {alignment}, the "
                f"expert token alignment the FP8 recipe needs; set it to {alignment} (or a multiple), or None "
                "to let the precision plugin set it."
            )
    return changed


@dataclass
class ConversionReport:
    """What an FP8 conversion did to a model."""

    converted: list[str] = field(default_factory=list)
    """Qualified names of the modules now computing in FP8."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Modules left in high precision, with the reason."""
    aligned_layers: list[str] = field(default_factory=list)
    """MoE layers whose ``router_padding_alignment`` was set."""


def is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a DTensor (tensor-parallel parameter), without importing DTensor."""
    return hasattr(tensor, "placements") and hasattr(tensor, "device_mesh")


def high_precision_prefixes(model: nn.Module, first_last_bf16: bool, at_start: int = 1, at_end: int = 1) -> tuple[str, ...]:
    """Qualified names of the transformer layers kept in high precision by ``first_last_bf16``.

    The layers are the children of the outermost ``nn.ModuleList`` named ``layers`` (the reference
    model's ``layers``; ``model.layers`` inside a LightningModule).
    """
    if not first_last_bf16:
        return ()
    if at_start < 0 or at_end < 0:
        raise ValueError(f"num_layers_at_start_in_bf16 / _end_ must be >= 0, got {at_start} / {at_end}.")
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and name.split(".")[-1] == "layers"]
    if not found:
        raise ValueError(
            "first_last_bf16=True needs the model's transformer layers in an nn.ModuleList named 'layers' "
            "(as in lightning_moe.models.MoETransformer); none was found."
        )
    prefix, layers = found[0]
    count = len(layers)
    if at_start + at_end >= count:
        raise ValueError(
            f"first_last_bf16 keeps {at_start} + {at_end} of the {count} layers in bf16: nothing would run in "
            "FP8. Lower num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16."
        )
    keep = list(range(at_start)) + list(range(count - at_end, count))
    return tuple(f"{prefix}.{i}" for i in keep)


def skip_reason(name: str, prefixes: Sequence[str], patterns: Sequence[str]) -> str | None:
    """Why the module called ``name`` stays high precision (None: convert it)."""
    for prefix in prefixes:
        if name == prefix or name.startswith(prefix + "."):
            return f"first/last layer kept in bf16 ({prefix})"
    for pattern in patterns:
        if fnmatch.fnmatchcase(name, pattern):
            return f"matches skip pattern {pattern!r}"
    return None
