"""Context parallelism: each sequence sharded over the CP ranks, attention computed across them.

* :mod:`.exchange`: the load-balanced sharding of a sequence and the causal attention of a rank's
  chunks over the whole sequence, by all-gather or by the ring;
* :mod:`.ring`: the ring exchange (K/V blocks passed along, partial results merged by log-sum-exp);
* :mod:`.blocks`: the per-block attention kernels returning the log-sum-exp (math, PyTorch's fused
  CPU and CUDA flash kernels), with masks for partly visible blocks;
* :mod:`.lse`: attention through those kernels with attention sinks and sliding windows (also what
  one device runs for GPT-OSS's attention);
* :mod:`.apply`: a model made context parallel from its plan (which modules are core attention),
  the batch sharding and the per-token loss mean across CP ranks.
"""

from lightning_moe.parallel.context_parallel.apply import (
    ContextParallelCoreAttention,
    apply_context_parallel,
    context_parallel_positions,
    context_parallel_problem,
    cp_token_mean,
    shard_batch,
)
from lightning_moe.parallel.context_parallel.exchange import (
    CP_COMM_TYPES,
    context_parallel_attention,
    load_balanced_positions,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "CP_COMM_TYPES", "ContextParallelCoreAttention", "apply_context_parallel", "context_parallel_attention",
    "context_parallel_positions", "context_parallel_problem", "cp_token_mean", "load_balanced_positions",
    "shard_batch", "shard_sequence", "unshard_sequence",
]
