"""Everything that knows ranks: the folded layout (`ParallelDims`), its process groups
(`ParallelContext`), token dispatchers and the functions that apply parallelism to a model."""

from lightning_moe.parallel.context import ParallelContext, build_parallel_context
from lightning_moe.parallel.dims import GROUP_NAMES, ParallelDims, RankCoords
from lightning_moe.parallel.dispatchers import AllGatherDispatcher, AllToAllDispatcher, DispatchStats
from lightning_moe.parallel.expert_parallel import apply_expert_parallel, expert_shard, is_expert_param
from lightning_moe.parallel.parallelize import parallelize

__all__ = [
    "GROUP_NAMES",
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "DispatchStats",
    "ParallelContext",
    "ParallelDims",
    "RankCoords",
    "apply_expert_parallel",
    "build_parallel_context",
    "expert_shard",
    "is_expert_param",
    "parallelize",
]
