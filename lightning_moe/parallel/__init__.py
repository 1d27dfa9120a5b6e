"""Everything that knows ranks: the folded layout (`ParallelDims`), its process groups
(`ParallelContext`), token dispatchers and the functions that apply parallelism to a model."""

from lightning_moe.parallel.dispatchers import AllGatherDispatcher, AllToAllDispatcher, DispatchStats
from lightning_moe.parallel.expert_parallel import apply_expert_parallel, expert_shard, is_expert_param
from lightning_moe.parallel.fully_shard import SHARDING_STRATEGIES, apply_fully_shard
from lightning_moe.parallel.gradient_sync import GradientSync
from lightning_moe.parallel.layout.dims import GROUP_NAMES, ParallelDims, RankCoords
from lightning_moe.parallel.layout.groups import ParallelContext, build_parallel_context
from lightning_moe.parallel.mixed_step import allow_mixed_tensors, mixed_tensor_updates
from lightning_moe.parallel.options import ParallelOptions
from lightning_moe.parallel.parallelize import parallelize
from lightning_moe.parallel.sharded_grad_sync import ShardedGradSync

__all__ = [
    "GROUP_NAMES",
    "SHARDING_STRATEGIES",
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "DispatchStats",
    "GradientSync",
    "ParallelContext",
    "ParallelDims",
    "ParallelOptions",
    "RankCoords",
    "ShardedGradSync",
    "allow_mixed_tensors",
    "apply_expert_parallel",
    "apply_fully_shard",
    "build_parallel_context",
    "expert_shard",
    "is_expert_param",
    "mixed_tensor_updates",
    "parallelize",
]
