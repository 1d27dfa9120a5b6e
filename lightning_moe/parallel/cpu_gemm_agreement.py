"""One CPU GEMM library choice for every rank of a job (the expert kernel's ``auto`` backend).

:mod:`lightning_moe.layers.cpu_gemm` times ATen's BLAS against oneDNN once per process and layer
shape. Processes of one job measure separately, with other thread counts or under other load, so
two ranks can choose differently and sum in different orders: replicated results then differ in
the last bits between ranks, and two runs of the same job differ. :func:`agree_on_cpu_gemm`
measures on rank 0 only and pins those choices on every rank.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from lightning_moe.layers.cpu_gemm import cpu_gemm_backend, measured_cpu_gemm_choice, pin_cpu_gemm_choices
from lightning_moe.layers.experts import GroupedExperts

__all__ = ["agree_on_cpu_gemm", "describe_cpu_gemm_choices"]


def agree_on_cpu_gemm(model: nn.Module) -> dict[tuple[int, int], str]:
    """Measure the ``auto`` choice of every expert fc1 shape of ``model`` on rank 0; pin it on all ranks.

    Collective over the default process group (every rank calls it, after the experts were
    sharded, so the shapes are the local ones). Returns the pinned ``{(in, out): backend}``;
    empty when a backend is forced (:data:`~lightning_moe.layers.cpu_gemm.ENV_VAR`, the same on
    every rank of a launch) or without a process group.
    """
    if not dist.is_initialized() or cpu_gemm_backend() != "auto":
        return {}
    shapes = sorted({
        (int(m.fc1_weight.shape[2]), int(m.fc1_weight.shape[1])) for m in model.modules()
        if isinstance(m, GroupedExperts)
    })
    choices = [{shape: measured_cpu_gemm_choice(*shape) for shape in shapes} if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choices, src=0)
    pin_cpu_gemm_choices(choices[0])
    return choices[0]


def describe_cpu_gemm_choices(choices: dict[tuple[int, int], str]) -> str:
    """One line for the log, e.g. ``"onednn for fc1 [64, 32]; aten for fc1 [16, 8]"``."""
    by_backend: dict[str, list[str]] = {}
    for (in_features, out_features), name in sorted(choices.items()):
        by_backend.setdefault(name, []).append(f"[{out_features}, {in_features}]")
    return "; ".join(f"{name} for fc1 {', '.join(shapes)}" for name, shapes in sorted(by_backend.items()))
