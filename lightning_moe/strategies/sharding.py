"""How `MoEStrategy` sets up sharded data parallelism: precision policy and the combinations refused.

The sharding itself is :func:`~lightning_moe.parallel.fully_shard.apply_fully_shard`; this module
maps the Trainer's settings onto it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from lightning.pytorch import Callback
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_moe.callbacks.cuda_graphs import CUDAGraphCapture
from lightning_moe.parallel.grad_sync import GradSync
from lightning_moe.parallel.gradient_sync import GradientSync
from lightning_moe.parallel.layout.groups import ParallelContext
from lightning_moe.parallel.sharded_grad_sync import ShardedGradSync
from lightning_moe.plugins.fp8 import MoEFP8Precision

__all__ = ["check_sharding_combination", "make_grad_sync", "sharding_mp_policy"]


def sharding_mp_policy(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2's mixed precision for the Trainer's ``precision``.

    ``bf16-mixed``: parameters gathered and computed in bf16, gradients reduced in fp32 into the
    fp32 sharded (master) parameters. Other precisions compute in the parameters' own dtype.
    """
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def check_sharding_combination(
    sharding_strategy: str, precision_plugin: Precision, callbacks: Iterable[Callback]
) -> None:
    """Raise ``ValueError`` for what does not combine with a sharded strategy yet, naming both options."""
    if sharding_strategy == "NO_SHARD":
        return
    precision = str(getattr(precision_plugin, "precision", ""))
    refused = {
        "16-mixed": "fp16 loss scaling of sharded gradients is not supported",
    }
    if precision in refused:
        raise ValueError(
            f"sharding_strategy={sharding_strategy!r} does not combine with precision={precision!r} yet "
            f"({refused[precision]}); use precision='bf16-mixed' (recommended) or sharding_strategy='NO_SHARD'."
        )
    if isinstance(precision_plugin, MoEFP8Precision):
        raise ValueError(
            f"sharding_strategy={sharding_strategy!r} does not combine with the MoEFP8Precision plugin yet "
            "(its FP8 weight caches would hold gathered shards); drop the plugin or use sharding_strategy='NO_SHARD'."
        )
    for callback in callbacks:
        if isinstance(callback, CUDAGraphCapture):
            raise ValueError(
                f"sharding_strategy={sharding_strategy!r} does not combine with the CUDAGraphCapture callback yet "
                "(FSDP2 gathers and frees parameters inside the captured region); remove the callback or use "
                "sharding_strategy='NO_SHARD'."
            )


def make_grad_sync(
    sharding_strategy: str, model: nn.Module, ctx: ParallelContext, bucket_size_mb: float, automatic_optimization: bool,
    grad_reduce_in_fp32: bool = True, defer_gradient_reduction: bool = False,
) -> GradientSync:
    """The gradient synchronisation of the strategy's model (``grad_reduce_in_fp32``: see `GradSync`;
    FSDP2 reduces in its `MixedPrecisionPolicy`'s dtype instead; ``defer_gradient_reduction``: see
    `ShardedGradSync`)."""
    if sharding_strategy != "NO_SHARD":
        return ShardedGradSync(model, ctx, defer_gradient_reduction)  # FSDP2 reduces during backward
    # Manual optimization may run several backward passes before one step: reduce at the step (or
    # on clipping / finish_grad_sync) instead of during backward.
    return GradSync(
        model, ctx, bucket_size_mb, overlap=automatic_optimization, explicit_backward=True,
        grad_reduce_in_fp32=grad_reduce_in_fp32,
    )
