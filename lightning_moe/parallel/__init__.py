"""Everything that knows ranks: the folded layout (`ParallelDims`) and its process groups (`ParallelContext`)."""

from lightning_moe.parallel.context import ParallelContext, build_parallel_context
from lightning_moe.parallel.dims import GROUP_NAMES, ParallelDims, RankCoords

__all__ = ["GROUP_NAMES", "ParallelContext", "ParallelDims", "RankCoords", "build_parallel_context"]
