"""`convert_to_float8`: swap a model's linear layers and grouped experts to the torch FP8 backend, in place.

Above both :mod:`~lightning_moe.precision.torch_fp8` (``Float8Linear``) and
:mod:`~lightning_moe.precision.torch_fp8_experts` (``Float8GroupedExperts``), which it chooses between.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.precision.common import ConversionReport, is_dtensor, skip_reason
from lightning_moe.precision.torch_fp8 import GEMM_ALIGN, Float8Linear, TorchFP8Recipe
from lightning_moe.precision.torch_fp8_experts import Float8GroupedExperts

__all__ = ["convert_to_float8"]


def _fp8_shapes_ok(*sizes: int) -> bool:
    return all(size % GEMM_ALIGN == 0 for size in sizes)


def convert_to_float8(
    model: nn.Module,
    recipe: TorchFP8Recipe,
    skip: Sequence[str] = ("*lm_head",),
    high_precision: Sequence[str] = (),
    linears: bool = True,
) -> ConversionReport:
    """Switch every eligible ``nn.Linear`` (with ``linears``) and ``GroupedExperts`` of ``model`` to FP8, in place.

    Class swaps (:class:`Float8Linear`, :class:`~lightning_moe.precision.torch_fp8_experts.
    Float8GroupedExperts`) keep parameters, state-dict keys, expert-shard tags and hooks. Left in
    high precision: modules under ``high_precision`` prefixes (first/last layers), names matching
    ``skip`` patterns, layers whose features are not multiples of 16, and routers (not
    ``nn.Linear``; they keep their fp32 weights and ``router_dtype``). Tensor-parallel (DTensor)
    weights raise ``ValueError``.
    """
    report = ConversionReport()
    kinds = (nn.Linear, GroupedExperts) if linears else (GroupedExperts,)
    for name, module in model.named_modules():
        if not isinstance(module, kinds) or isinstance(module, (Float8Linear, Float8GroupedExperts)):
            continue
        reason = skip_reason(name, high_precision, skip)
        if reason is not None:
            report.skipped[name] = reason
            continue
        if any(is_dtensor(p) for p in module.parameters(recurse=False)):
            raise ValueError(
                f"{name}: tensor-parallel (DTensor) weights are not supported by the torch FP8 backend; use "
                "tensor_parallel_size=1 or backend='te'."
            )
        if isinstance(module, nn.Linear):
            if not _fp8_shapes_ok(module.in_features, module.out_features):
                report.skipped[name] = f"features {module.in_features}->{module.out_features} not multiples of 16"
                continue
            module.__class__ = Float8Linear
        else:
            fc1_rows = module.fc1_weight.shape[1]
            if not _fp8_shapes_ok(module.hidden_size, module.ffn_hidden_size, fc1_rows):
                report.skipped[name] = f"hidden {module.hidden_size} / ffn {module.ffn_hidden_size} not multiples of 16"
                continue
            module.__class__ = Float8GroupedExperts
        module.fp8_recipe = recipe
        report.converted.append(name)
    return report
