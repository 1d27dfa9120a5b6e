"""`GradSync` and `ShardedGradSync` both implement the declared `GradientSync` protocol.

Each is driven through a function typed only by the protocol (the strategy's sequence: two
accumulated micro-batches, the second synchronised, then ``reduce_accumulated`` and ``finish``) on
2 gloo ranks. Oracle: the mean over ranks of the summed micro-batch gradients, computed on one
process from the same inputs.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from helpers.asserts import assert_close_to_scale
from helpers.dist import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe.parallel import (
    GradientSync,
    ParallelDims,
    ShardedGradSync,
    apply_fully_shard,
    build_parallel_context,
)
from lightning_moe.parallel.grad_sync import GradSync

pytestmark = pytest.mark.distributed

WORLD, MICRO = 2, 2
GRAD_RTOL = 1e-6  # fp32 sums of two terms in another order


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _inputs(rank: int, micro: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * rank + micro))


def _drive(sync: GradientSync, model: nn.Module, rank: int) -> None:
    """One optimizer step's backward passes, as the strategy and the pipeline runner drive them."""
    for micro in range(MICRO):
        last = micro == MICRO - 1
        with nullcontext() if last else sync.no_sync():
            assert sync.sync_enabled == last
            sync.begin_backward()
            model(_inputs(rank, micro)).square().sum().backward()
            sync.end_backward()
    sync.reduce_accumulated()
    sync.finish()
    sync.finish()  # idempotent


def _run(rank: int, world: int, sharded: bool) -> dict:
    ctx = build_parallel_context(ParallelDims(world), "cpu")
    model = _model()
    if sharded:
        apply_fully_shard(model, ctx, "FULL_SHARD")
        sync = ShardedGradSync(model, ctx)
    else:
        sync = GradSync(model, ctx, explicit_backward=True)
    conforms = isinstance(sync, GradientSync)
    _drive(sync, model, rank)
    sync.remove_hooks()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
    return {"conforms": conforms, "grads": grads}


def _oracle() -> dict[str, torch.Tensor]:
    model = _model()
    for rank in range(WORLD):
        for micro in range(MICRO):
            (model(_inputs(rank, micro)).square().sum() / WORLD).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("sharded", [False, True], ids=["GradSync", "ShardedGradSync"])
def test_both_gradient_syncs_follow_the_protocol(tmp_path, sharded):
    want = _oracle()
    for rank, result in enumerate(run_distributed(_run, WORLD, sharded, tmp_dir=tmp_path)):
        assert result["conforms"], f"rank {rank}: not a GradientSync"
        for name, grad in result["grads"].items():
            assert_close_to_scale(grad, want[name], GRAD_RTOL, f"rank {rank}: {name}")
