"""Transformer Engine FP8/FP4 backend: the one place that imports ``transformer_engine`` (lazily).

Importing ``lightning_moe`` (or this module) never imports Transformer Engine; every function that
needs it calls :func:`import_te`, which raises ``ImportError`` naming the install extra
(``pip install -e ".[te]"`` in a clone) when TE is missing or fails to load.

* Recipes (:func:`make_te_recipe`): ``delayed`` (``DelayedScaling``), ``tensorwise``
  (``Float8CurrentScaling``, per-tensor current scaling), ``blockwise`` (``Float8BlockScaling``,
  1x128 activation and 128x128 weight blocks, DeepSeek-V3 style), ``mxfp8``
  (``MXFP8BlockScaling``, 1x32 blocks with E8M0 scales, Blackwell) and ``nvfp4``
  (``NVFP4BlockScaling``, FP4), each where the installed TE has the class; otherwise a
  ``ValueError`` names the class, the installed version and the recipes available. A TE recipe
  object can be passed instead of a name.
* Amax reduction (:func:`amax_reduction_group`): as Megatron, scaling statistics are reduced over
  TP x DP x CP (``tp_only=True``: TP x CP), so shards and replicas quantise with identical scales.
  Lightning's ``TransformerEnginePrecision`` passes no group; here it comes from the
  ``ParallelContext``.
* Conversion (:func:`convert_to_te`): eligible ``nn.Linear`` s become ``te.Linear`` (weights
  copied; the state-dict keys ``weight``/``bias`` are unchanged and TE adds its ``_extra_state``
  with the FP8 metadata). Routed experts run on the ``torch`` backend's FP8 grouped GEMMs
  (row-wise, e4m3) under this backend too: TE's ``GroupedLinear`` holds one weight per expert,
  which would change the public ``[E, 2F, H]`` expert state-dict format and the expert-parallel
  checkpoint hooks built on it.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_moe.install_hints import install_hint
from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.precision.common import TE_RECIPES, ConversionReport, is_dtensor, skip_reason

__all__ = [
    "INSTALL_HINT",
    "amax_reduction_group",
    "available_te_recipes",
    "convert_to_te",
    "import_te",
    "make_te_recipe",
    "resolve_backend",
    "te_autocast",
    "te_available",
]

INSTALL_HINT = install_hint("te")
_TE_RECIPE_CLASSES = {
    "delayed": "DelayedScaling",
    "tensorwise": "Float8CurrentScaling",
    "blockwise": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
    "nvfp4": "NVFP4BlockScaling",
}
_FORMAT_RECIPES = ("delayed", "tensorwise")  # recipes whose fp8_format may be HYBRID
_BACKENDS = ("auto", "te", "torch")


def import_te():
    """``transformer_engine.pytorch``, or ``ImportError`` naming the ``te`` extra."""
    try:
        import transformer_engine.pytorch as te
    except Exception as err:  # ImportError, or a broken install failing to load its libraries
        raise ImportError(
            f"The 'te' FP8 backend needs NVIDIA Transformer Engine: {INSTALL_HINT} "
            f"(importing transformer_engine.pytorch failed: {type(err).__name__}: {err})."
        ) from err
    return te


def te_available() -> bool:
    """Whether Transformer Engine imports on this machine."""
    try:
        import_te()
    except ImportError:
        return False
    return True


def resolve_backend(backend: str) -> str:
    """``te`` or ``torch`` for a requested backend: ``auto`` is ``te`` when TE imports, else ``torch``.

    ``te`` without Transformer Engine raises ``ImportError`` naming the extra.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"Unknown FP8 backend {backend!r}; choose one of {list(_BACKENDS)}.")
    if backend == "auto":
        return "te" if te_available() else "torch"
    if backend == "te":
        import_te()
    return backend


def _te_version() -> str:
    import transformer_engine

    return getattr(transformer_engine, "__version__", "unknown")


def available_te_recipes() -> tuple[str, ...]:
    """The recipe names the installed Transformer Engine supports."""
    import_te()
    from transformer_engine.common import recipe as te_recipe

    return tuple(name for name, cls in _TE_RECIPE_CLASSES.items() if hasattr(te_recipe, cls))


def make_te_recipe(recipe: Any = "delayed", fp8_format: str = "hybrid", **kwargs) -> Any:
    """A TE recipe object from a name of :data:`~lightning_moe.precision.common.TE_RECIPES` (objects pass through).

    ``fp8_format`` (``hybrid``: e4m3 forward, e5m2 gradients; or ``e4m3``) applies to ``delayed``
    and ``tensorwise``; the block recipes use e4m3. ``kwargs`` go to the recipe class.
    """
    if not isinstance(recipe, str):
        return recipe
    if recipe not in TE_RECIPES:
        raise ValueError(f"Unknown Transformer Engine FP8 recipe {recipe!r}; choose one of {list(TE_RECIPES)}.")
    if fp8_format not in ("hybrid", "e4m3"):
        raise ValueError(f"fp8_format must be 'hybrid' or 'e4m3', got {fp8_format!r}.")
    import_te()
    from transformer_engine.common import recipe as te_recipe

    class_name = _TE_RECIPE_CLASSES[recipe]
    cls = getattr(te_recipe, class_name, None)
    if cls is None:
        raise ValueError(
            f"FP8 recipe {recipe!r} needs transformer_engine.common.recipe.{class_name}, which the installed "
            f"Transformer Engine {_te_version()} lacks; upgrade it ({INSTALL_HINT}) or choose one of "
            f"{list(available_te_recipes())}."
        )
    if recipe in _FORMAT_RECIPES:
        kwargs.setdefault("fp8_format", getattr(te_recipe.Format, fp8_format.upper()))
    return cls(**kwargs)


def amax_reduction_group(ctx: Any, tp_only: bool = False):
    """The process group FP8 scaling statistics are reduced over, from a ``ParallelContext``.

    TP x DP x CP (Megatron's default), or TP x CP with ``tp_only``; None when that group has one
    rank or there is no context. Any object with ``group(name)`` and ``size(name)`` works.
    """
    if ctx is None:
        return None
    name = "tp_cp" if tp_only else "tp_dp_cp"
    return ctx.group(name) if ctx.size(name) > 1 else None


def te_autocast(recipe: Any, amax_group=None):
    """TE's FP8 autocast context for ``recipe`` with the amax reduction group (old and new TE APIs)."""
    te = import_te()
    autocast = getattr(te, "autocast", None)
    if autocast is not None:
        params = inspect.signature(autocast).parameters
        if "recipe" in params:
            group_arg = "amax_reduction_group" if "amax_reduction_group" in params else "fp8_group"
            return autocast(enabled=True, recipe=recipe, **{group_arg: amax_group})
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=amax_group)


def _feature_multiple(recipe: Any) -> int:
    name = recipe if isinstance(recipe, str) else type(recipe).__name__
    return 32 if name in ("mxfp8", "nvfp4", "MXFP8BlockScaling", "NVFP4BlockScaling") else 16


def convert_to_te(
    model: nn.Module,
    recipe: Any,
    skip: Sequence[str] = ("*lm_head",),
    high_precision: Sequence[str] = (),
) -> ConversionReport:
    """Replace eligible ``nn.Linear`` s by ``te.Linear`` and switch experts to torch FP8 (module docstring)."""
    from lightning_moe.precision.torch_fp8 import TorchFP8Recipe
    from lightning_moe.precision.torch_fp8_convert import convert_to_float8

    te = import_te()
    report = ConversionReport()
    multiple = _feature_multiple(recipe)
    replacements = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is not nn.Linear:
                continue
            reason = skip_reason(name, high_precision, skip)
            if reason is None and (child.in_features % multiple or child.out_features % multiple):
                reason = f"features {child.in_features}->{child.out_features} not multiples of {multiple}"
            if reason is not None:
                report.skipped[name] = reason
                continue
            if is_dtensor(child.weight):
                raise ValueError(
                    f"{name}: tensor-parallel (DTensor) weights cannot be converted to te.Linear by this "
                    "plugin; use tensor_parallel_size=1."
                )
            replacements.append((parent, child_name, name, child))
    for parent, child_name, name, child in replacements:
        device = child.weight.device if child.weight.is_cuda else torch.device("cuda")
        layer = te.Linear(
            child.in_features, child.out_features, bias=child.bias is not None,
            params_dtype=child.weight.dtype, device=device,
        )
        with torch.no_grad():
            layer.weight.copy_(child.weight)
            if child.bias is not None:
                layer.bias.copy_(child.bias)
        setattr(parent, child_name, layer)
        report.converted.append(name)
    has_experts = any(isinstance(m, GroupedExperts) for m in model.modules())
    if has_experts:
        experts = convert_to_float8(model, TorchFP8Recipe("rowwise"), skip, high_precision, linears=False)
        report.converted += experts.converted
        report.skipped.update(experts.skipped)
    return report
