"""The optimizer pieces of :class:`~lightning_moe.lit.MoELanguageModel`: AdamW's parameter groups and
kernel choice, and the warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch

__all__ = ["adamw_kernel_options", "optimizer_param_groups", "warmup_cosine"]


def optimizer_param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight matrices (experts included) decay; norms, biases (the experts' stacked
    ones included), attention sinks and the embedding do not.

    Built from ``named_parameters()`` and checked to cover every trainable parameter exactly once,
    so no parameter (an expert shard, a router) can silently drop out of optimisation.
    """
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        # Biases may be stacked per expert ([E, H], [E, 2, F]): by name, not by shape.
        vector = param.dim() < 2 or name.endswith(("bias", "sinks")) or "embed" in name
        (no_decay if vector else decay).append(param)
    trainable = [p for p in module.parameters() if p.requires_grad]
    if len(decay) + len(no_decay) != len(trainable):
        raise RuntimeError(
            f"Optimizer groups cover {len(decay) + len(no_decay)} of {len(trainable)} trainable parameters."
        )
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def adamw_kernel_options(device_types: set[str]) -> dict[str, bool]:
    """AdamW's kernel for parameters on ``device_types``: the fused kernel when all are on CUDA.

    torch's default there, the foreach kernels, holds an fp32 temporary of every parameter of a
    group at once during the step (4 bytes per parameter the rank holds: 21.75 GiB for
    Mixtral-8x7B replicated at TP=8, EP=8, benchmarks/RESULTS.md); the fused kernel updates in
    place. Elsewhere torch's default (the per-parameter loop on CPU) is kept.
    """
    return {"fused": True} if device_types == {"cuda"} else {}


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up, then cosine decay to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
