"""`write_full`: copy a weight's full initial values into it, whatever parallelism split it.

Layers draw their initial weights in full, from their own generators, so every parallel layout
starts from the one-device numbers. A weight that tensor or sharded data parallelism turned into
a DTensor keeps only the slice its placements give this rank; every rank drew the same values, so
no communication is needed. Cutting that slice needs ``torch.distributed``, which this package
does not use: the functions of :mod:`lightning_moe.parallel` that shard weights hand over the writer
(:func:`set_sharded_writer`, through ``lightning_moe.parallel.sharded_init.enable_sharded_init``)
before any weight becomes a DTensor. Importing either package installs nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

__all__ = ["reset_adapters", "set_sharded_writer", "write_full"]

ShardedWriter = Callable[[Tensor, Tensor, "int | None"], None]
_sharded_writer: ShardedWriter | None = None


def set_sharded_writer(writer: ShardedWriter) -> None:
    """Install ``writer(weight, values, index)``, which writes into a DTensor ``weight`` (see :func:`write_full`)."""
    global _sharded_writer
    _sharded_writer = writer


def write_full(weight: Tensor, values: Tensor, index: int | None = None) -> None:
    """``weight.copy_(values)`` (or ``weight[index].copy_(values)``), keeping this rank's slice of a DTensor."""
    if hasattr(weight, "placements"):
        if _sharded_writer is None:
            raise RuntimeError(
                f"write_full got a DTensor weight (placements {weight.placements}) but no writer for it: the "
                "weight was sharded outside lightning_moe.parallel's apply functions. Call "
                "lightning_moe.parallel.sharded_init.enable_sharded_init() before reset_parameters()."
            )
        _sharded_writer(weight, values, index)
    elif index is None:
        weight.copy_(values)
    else:
        weight[index].copy_(values)


def reset_adapters(module: nn.Module) -> None:
    """Re-draw the adapters (``reset_adapter_parameters()``, e.g. LoRA's) of every submodule of ``module``.

    Called last by the layers and models that draw their whole subtree themselves, so adapters
    added to their submodules get their initial values too when a meta-device model is materialised.
    """
    for sub in module.modules():
        reset = getattr(sub, "reset_adapter_parameters", None)
        if callable(reset):
            reset()
