"""`MoEFP8Precision`: FP8 training of MoE models as one Lightning precision plugin, two backends.

::

    Trainer(accelerator="gpu", plugins=[MoEFP8Precision(backend="torch", recipe="rowwise")],
            strategy=MoEStrategy(...))

(Pass it in ``plugins``, not as ``precision=``: a Precision object bypasses Lightning's check of
the precision string, ``AcceleratorConnector._validate_precision_choice``, which accepts only
``32-true``, ``bf16-mixed``, ``bf16-true`` and ``16-true`` for a ``ModelParallelStrategy``.)

* ``backend``: ``torch`` (PyTorch's scaled FP8 GEMMs, :mod:`lightning_moe.precision.torch_fp8`),
  ``te`` (Transformer Engine, :mod:`lightning_moe.precision.te_fp8`) or ``auto`` (``te`` when
  Transformer Engine imports, else ``torch``). ``te`` without TE raises ``ImportError`` naming
  ``pip install -e ".[te]"`` when the plugin is built. The ``torch`` backend raises
  ``RuntimeError`` in :meth:`MoEFP8Precision.convert_module` (the start of ``fit``, not import or
  construction) when no FP8-capable CUDA GPU is present, so configurations still parse on CPU.
* ``recipe``: ``rowwise`` (default) / ``tensorwise`` for ``torch``; ``delayed`` (default) /
  ``tensorwise`` / ``blockwise`` / ``mxfp8`` / ``nvfp4`` for ``te``; or a recipe object
  (:class:`~lightning_moe.precision.TorchFP8Recipe`, a TE recipe).
* Numerics around the FP8 GEMMs: fp32 master weights (``weights_dtype="bfloat16"`` to store them
  in bf16), every other op under ``torch.autocast(bfloat16)`` (the ``bf16-mixed`` baseline FP8
  runs are compared with); routers stay fp32 (their weights and ``router_dtype``) and the output
  head stays high precision (``skip_modules``); ``first_last_bf16`` keeps the first and last
  ``num_layers_at_start_in_bf16`` / ``num_layers_at_end_in_bf16`` layers out of FP8.
* Expert token alignment: ``align_expert_tokens`` sets each dropless MoE layer's
  ``router_padding_alignment`` to what the recipe needs (16; 32 for MXFP8; 128 for NVFP4).
* ``te``: the amax reduction group is TP x DP x CP of ``MoEStrategy``'s parallel context (TP x CP
  with ``tp_only_amax_reduction``), or the world under other data-parallel strategies.

Why not a subclass of Lightning's ``TransformerEnginePrecision``: its constructor requires TE (the
``torch`` backend must work without it), it casts the whole module to ``weights_dtype`` (routers
included), enters TE's autocast without an amax-reduction group, and has no first/last-layer or
expert-alignment options. The plugin keeps its shape: ``convert_module`` swaps layers,
``forward_context`` enters a bf16 autocast fallback and TE's FP8 autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_utilities import apply_to_collection
from torch import Tensor, nn

from lightning_moe.layers.router import TopKRouter
from lightning_moe.precision.common import (
    TORCH_RECIPES,
    ConversionReport,
    apply_token_alignment,
    high_precision_prefixes,
    token_alignment,
)
from lightning_moe.precision.te_fp8 import (
    amax_reduction_group,
    convert_to_te,
    make_te_recipe,
    resolve_backend,
    te_autocast,
)
from lightning_moe.precision.torch_fp8 import TorchFP8Recipe, require_fp8_device
from lightning_moe.precision.torch_fp8_convert import convert_to_float8

__all__ = ["MoEFP8Precision"]

_WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class MoEFP8Precision(Precision):
    """FP8 GEMMs for attention, dense and expert projections; see the module docstring."""

    def __init__(
        self,
        backend: str = "auto",
        recipe: str | Any | None = None,
        first_last_bf16: bool = False,
        num_layers_at_start_in_bf16: int = 1,
        num_layers_at_end_in_bf16: int = 1,
        weights_dtype: str = "float32",
        align_expert_tokens: bool = True,
        tp_only_amax_reduction: bool = False,
        skip_modules: Sequence[str] = ("*lm_head",),
        fp8_format: str = "hybrid",
    ) -> None:
        self.backend = resolve_backend(backend)
        if isinstance(weights_dtype, str):
            if weights_dtype not in _WEIGHT_DTYPES:
                raise ValueError(f"weights_dtype must be one of {sorted(_WEIGHT_DTYPES)}, got {weights_dtype!r}.")
            weights_dtype = _WEIGHT_DTYPES[weights_dtype]
        if weights_dtype not in _WEIGHT_DTYPES.values():
            raise ValueError(f"weights_dtype must be torch.float32 or torch.bfloat16, got {weights_dtype}.")
        self.weights_dtype = weights_dtype
        self.precision = "bf16-true" if weights_dtype == torch.bfloat16 else "bf16-mixed"
        self.recipe = self._make_recipe(recipe, fp8_format)
        self.first_last_bf16 = first_last_bf16
        self.layers_in_bf16 = (num_layers_at_start_in_bf16, num_layers_at_end_in_bf16)
        self.align_expert_tokens = align_expert_tokens
        self.tp_only_amax_reduction = tp_only_amax_reduction
        self.skip_modules = tuple(skip_modules)
        self.report: ConversionReport | None = None
        """What ``convert_module`` converted and skipped (and why)."""
        self._amax_group = None

    def _make_recipe(self, recipe: Any, fp8_format: str) -> Any:
        if self.backend == "torch":
            if recipe is None:
                return TorchFP8Recipe()
            if isinstance(recipe, TorchFP8Recipe):
                return recipe
            if recipe not in TORCH_RECIPES:
                raise ValueError(
                    f"Recipe {recipe!r} is not a torch-backend recipe; choose one of {list(TORCH_RECIPES)} "
                    "(or backend='te' for Transformer Engine's recipes)."
                )
            return TorchFP8Recipe(scaling=recipe)
        if recipe == "rowwise" or isinstance(recipe, TorchFP8Recipe):
            raise ValueError(
                "Recipe 'rowwise' belongs to the torch backend; Transformer Engine's closest is 'blockwise' "
                "(or pass backend='torch')."
            )
        return make_te_recipe("delayed" if recipe is None else recipe, fp8_format)

    @property
    def recipe_name(self) -> str:
        """Short name of the recipe (``rowwise``, ``delayed``, ``mxfp8``, ...)."""
        if isinstance(self.recipe, TorchFP8Recipe):
            return self.recipe.scaling
        return type(self.recipe).__name__

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap eligible layers for FP8 ones (raises on machines without an FP8-capable CUDA GPU)."""
        prefixes = high_precision_prefixes(module, self.first_last_bf16, *self.layers_in_bf16)
        if self.backend == "torch":
            require_fp8_device(self.recipe)
            report = convert_to_float8(module, self.recipe, self.skip_modules, prefixes)
        else:
            report = convert_to_te(module, self.recipe, self.skip_modules, prefixes)
            self._amax_group = self._find_amax_group(module)
        if self.align_expert_tokens:
            alignment = token_alignment(self.recipe_name if self.backend == "torch" else self.recipe)
            report.aligned_layers = apply_token_alignment(module, alignment)
        if self.weights_dtype != torch.float32:
            module.to(dtype=self.weights_dtype)
            for router in (m for m in module.modules() if isinstance(m, TopKRouter)):
                router.float()
        self.report = report
        rank_zero_info(
            f"MoEFP8Precision({self.backend}, {self.recipe_name}): {len(report.converted)} modules in FP8, "
            f"{len(report.skipped)} kept in high precision."
        )
        return module

    def _find_amax_group(self, module: nn.Module):
        trainer = getattr(module, "_trainer", None)
        ctx = getattr(getattr(trainer, "strategy", None), "parallel_context", None)
        if ctx is not None:
            return amax_reduction_group(ctx, self.tp_only_amax_reduction)
        dist = torch.distributed
        if not self.tp_only_amax_reduction and dist.is_available() and dist.is_initialized():
            return dist.group.WORLD if dist.get_world_size() > 1 else None
        return None

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return _default_dtype(self.weights_dtype) if self.weights_dtype != torch.float32 else contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    def forward_context(self) -> contextlib.AbstractContextManager:
        """bf16 autocast for everything outside the FP8 GEMMs (and TE's FP8 autocast for ``te``)."""
        stack = contextlib.ExitStack()
        if self.weights_dtype != torch.float32:
            stack.enter_context(_default_dtype(self.weights_dtype))
        stack.enter_context(torch.autocast(device_type="cuda", dtype=torch.bfloat16))
        if self.backend == "te":
            stack.enter_context(te_autocast(self.recipe, self._amax_group))
        return stack

    def convert_input(self, data: Any) -> Any:
        if self.weights_dtype == torch.float32:
            return data

        def cast(t: Tensor) -> Tensor:
            return t.to(self.weights_dtype) if torch.is_floating_point(t) else t

        return apply_to_collection(data, dtype=Tensor, function=cast)
