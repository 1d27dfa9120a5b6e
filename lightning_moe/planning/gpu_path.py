"""The memory a model takes on an H100/H200 under ``bf16-mixed``, on a CPU that computes nothing.

The planner (and the scale tests) run a training step of fake tensors on the CPU. Where the CPU
path of the package differs from the GPU's in what it keeps alive, :func:`take_the_gpu_path`
switches a model to the GPU's choice, so the bytes counted are a GPU's.
"""

from __future__ import annotations

from functools import partial

import torch

from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.models import CoreAttention

__all__ = ["take_the_gpu_path"]


class _FlashAttentionStandIn(torch.autograd.Function):
    """Causal attention with flash attention's memory: saves q, k, v, the output and the fp32
    log-sum-exp (``[B, heads, S]``), nothing of size ``S x S``, and the attention sinks when given
    (GPT-OSS; a sliding window keeps nothing more). Values are not computed (fake)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, sinks, _, _ = ctx.saved_tensors
        dsinks = None if sinks is None else torch.empty_like(sinks)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _flash_attention(
    module: CoreAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    # CUDA autocast runs attention in bf16 (CPU autocast leaves SDPA in fp32).
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
    return _FlashAttentionStandIn.apply(q.to(dtype), k.to(dtype), v.to(dtype), sinks)


def take_the_gpu_path(model: torch.nn.Module) -> None:
    """Make the CPU-fake model allocate as it does on an H100/H200 under bf16-mixed.

    * the experts: ``kernel="auto"`` picks ``grouped_mm`` there and saves the activation (on the
      CPU it picks the loop kernel, recomputes the activation and keeps a gradient workspace);
    * attention: a flash kernel, O(S) memory (the CPU's math SDPA, taken for MLA's unequal head
      widths and for GQA, materialises ``[B, heads, S, S]`` probabilities).
    """
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.kernel, module.recompute_activation = "grouped_mm", False
        elif isinstance(module, CoreAttention):
            module.forward = partial(_flash_attention, module)
