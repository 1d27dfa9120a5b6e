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
:func:`allow_mixed_tensors` switches on, and :func:`mixed_tensor_updates` for an optimizer's update
only. The parameter groups
stay as the model defines them (their structure is part of every optimizer checkpoint, which
must load at any layout), and the foreach and fused kernels are kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from lightning_moe.compat import dtensor_op_dispatcher

__all__ = ["allow_mixed_tensors", "mixed_tensor_updates"]


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
    dispatcher = dtensor_op_dispatcher()
    previous = dispatcher._allow_implicit_replication
    dispatcher._allow_implicit_replication = enabled
    try:
        yield
    finally:
        dispatcher._allow_implicit_replication = previous


@contextmanager
def mixed_tensor_updates(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """While the body runs, ``optimizer.step`` makes its update under :func:`allow_mixed_tensors`, and only that.

    A step given a closure runs it first, as torch's optimizers do, outside the mode: the forward,
    the backward and whatever the closure runs after them (Lightning's ``on_before_optimizer_step``
    hooks, gradient clipping) keep DTensor's check. ``step`` is replaced on the instance for the
    body only; whatever was there (torch's learning-rate schedulers wrap it) is called inside and
    put back afterwards.
    """
    own = optimizer.__dict__.get("step")
    original = optimizer.step

    def step(closure=None, **kwargs):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with allow_mixed_tensors():
            original(**kwargs)
        return loss

    optimizer.step = step
    try:
        yield
    finally:
        if own is None:
            del optimizer.step
        else:
            optimizer.step = own
