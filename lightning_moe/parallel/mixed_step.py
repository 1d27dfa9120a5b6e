"""Optimizer steps over DTensors and plain tensors together.

Tensor parallelism and FSDP2 turn parameters into DTensors while other parameters stay plain
tensors: expert shards always without sharding, and at TP > 1 the router and the shared expert,
which the tensor-parallel plan replicates. torch's optimizers run one ``_foreach_*`` (or fused) op
over each parameter group's whole list: their default on CUDA, an option elsewhere. DTensor
refuses an op whose arguments mix both kinds ("got mixed torch.Tensor and DTensor"), so the
first optimizer step of a GPU run failed while the same run on CPU, where the default is the
per-parameter loop, worked.

The update of every parameter is elementwise and local, so a plain tensor can take part as if it
were a replicated DTensor: that is DTensor's ``implicit_replication`` mode, which
:func:`allow_mixed_tensors` switches on for the optimizer's update only. The parameter groups
stay as the model defines them (their structure is part of every optimizer checkpoint, which
must load at any layout), and the foreach and fused kernels are kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch.distributed.tensor import DTensor

__all__ = ["allow_mixed_tensors"]


@contextmanager
def allow_mixed_tensors(enabled: bool = True) -> Iterator[None]:
    """In the body, DTensor ops take plain tensors as replicated DTensors (``enabled``) or refuse them.

    The previous setting comes back afterwards, so a step's closure can switch it off again: the
    model's forward and backward keep DTensor's check, which catches a plain tensor that should
    have been sharded. Wrap ``optimizer.step()`` in it (``MoEStrategy`` does, for every optimizer
    step); only elementwise, per-parameter updates belong inside, since a plain tensor that differs
    between ranks (an expert shard) is then labelled replicated.
    """
    # torch's implicit_replication() sets this flag and resets it to False on exit, which would
    # switch it off inside an enclosing step; this restores whatever was set before.
    dispatcher = DTensor._op_dispatcher
    previous = dispatcher._allow_implicit_replication
    dispatcher._allow_implicit_replication = enabled
    try:
        yield
    finally:
        dispatcher._allow_implicit_replication = previous
