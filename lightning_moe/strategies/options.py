"""The `MoEStrategy` options refused at construction, each with what to use instead."""

from __future__ import annotations

from lightning_moe.parallel.options import ParallelOptions

__all__ = ["SUPPORTED_START_METHODS", "check_strategy_options"]

SUPPORTED_START_METHODS = ("popen",)
"""Launchers that keep every rank's shards: Lightning's subprocess script launcher (or none)."""


def check_strategy_options(
    pipeline_parallel_size: int, context_parallel_size: int, start_method: str, options: ParallelOptions,
    defer_gradient_reduction: bool = False,
) -> None:
    """Raise ``ValueError`` for an option `MoEStrategy` cannot honour (yet), saying what to use instead.

    ``options`` checked its own names when it was built; the pipeline options are checked by
    :func:`~lightning_moe.parallel.pipeline.runner.check_pipeline_options`.
    """
    if pipeline_parallel_size < 1:
        raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size}: needs at least 1 stage.")
    if context_parallel_size < 1:
        raise ValueError(f"context_parallel_size={context_parallel_size}: needs at least 1 rank.")
    if defer_gradient_reduction and options.sharding_strategy == "NO_SHARD":
        raise ValueError(
            "defer_gradient_reduction=True applies to the sharded strategies (SHARD_GRAD_OP, FULL_SHARD); with "
            "sharding_strategy='NO_SHARD' the gradients are already reduced once per step, after the last "
            "micro-batch. Drop defer_gradient_reduction, or choose a sharded strategy."
        )
    if start_method not in SUPPORTED_START_METHODS:
        raise ValueError(
            f"start_method={start_method!r} is not supported by MoEStrategy: Lightning's multiprocessing "
            "launcher returns rank 0's local model state to the parent process, which would keep one "
            "expert shard and lose the rest. Use start_method='popen' (the default: each rank re-runs "
            "the script), or launch with torchrun / SLURM."
        )
