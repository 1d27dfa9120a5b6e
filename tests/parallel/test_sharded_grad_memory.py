"""Sharded gradients during gradient accumulation and pipeline micro-batches (FSDP2, `ShardedGradSync`).

On 4 forked gloo ranks, without Lightning:

* gradient accumulation of 2 micro-batches at TP=1, EP=2 (dense units over DP=4, experts over
  EDP=2), the first micro-batch's backward inside ``ShardedGradSync.no_sync()`` as the strategy
  runs it;
* a 1F1B pipeline step of 4 micro-batches at PP=2 (DP=2, EDP=2), sharded after the trim as the
  strategy does.

Oracles: the rank's parameter shards (what FSDP2 holds of each parameter: the gradient shards
must have exactly their sizes; their count is ``scale.formula.local_parameters`` of the config
with ``fsdp``) and the same run with ``NO_SHARD`` (its local parameters, the formula without
``fsdp``, are what one rank holds unsharded; its gradients, reduced once per step by
``GradSync``, what the sharded gradients must equal at fp32 tolerance). After the backward of every micro-batch, by default, every
parameter's gradient is its shard (a DTensor of the parameter shard's local shape) and FSDP2 holds
no unsharded gradient (1/DP of ``NO_SHARD``'s gradient memory for dense parameters, 1/EDP for
experts); with ``defer_gradient_reduction=True`` the gradients stay unsharded, the ``NO_SHARD``
size (DP or EDP times the shards), until the step's reduction.

What the CPU cannot show: the peak device memory and whether the per-micro-batch reduce-scatters
overlap the next unit's backward. ``benchmarks/gpu_check.sh`` should run ``FULL_SHARD`` with
``accumulate_grad_batches=4`` at DP >= 2 and compare ``torch.cuda.max_memory_allocated`` with and
without ``defer_gradient_reduction`` (the deferred run higher by about the unsharded gradients'
bytes less the shards').
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from helpers.dist import run_distributed
from helpers.fsdp import held_gradients
from parallel.test_fully_shard_root import config
from scale.formula import local_parameters
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from lightning_moe.layers.loss_scale import set_aux_loss_scale
from lightning_moe.models import MoETransformer
from lightning_moe.models.transformer import next_token_loss
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize
from lightning_moe.parallel.grad_sync import GradSync
from lightning_moe.parallel.options import ParallelOptions
from lightning_moe.parallel.pipeline.runner import PipelineRunner
from lightning_moe.parallel.sharded_grad_sync import ShardedGradSync
from lightning_moe.strategies.model_setup import prepare_model

pytestmark = pytest.mark.distributed

WORLD = 4
SEQ = 8
MICRO = 2  # gradient accumulation
M = 4  # pipeline micro-batches
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6  # fp32 gradients reduced in another order (reduce-scatter vs all-reduce)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _sync(model, ctx, sharding: str, defer: bool):
    if sharding == "NO_SHARD":
        return GradSync(model, ctx, 25.0, explicit_backward=True)
    # No keyword without deferral: the default is what a plain ShardedGradSync(model, ctx) does.
    return ShardedGradSync(model, ctx, defer_gradient_reduction=True) if defer else ShardedGradSync(model, ctx)


def _shard_shapes_match(params) -> bool:
    return all(p.grad is not None and isinstance(p.grad, DTensor) and _local(p.grad).shape == _local(p).shape
               for p in params)


def _accumulate(rank: int, world_size: int, sharding: str, defer: bool = False) -> dict:
    torch.manual_seed(0)
    model = MoETransformer(config())
    ctx = build_parallel_context(ParallelDims(world_size, ep=2, etp=1), "cpu")
    parallelize(model, ctx, sharding_strategy=sharding)
    sync = _sync(model, ctx, sharding, defer)
    set_aux_loss_scale(model, 1.0 / MICRO)
    held, shaped = [], []
    for micro in range(MICRO):
        tokens = torch.randint(0, 64, (2, SEQ + 1), generator=torch.Generator().manual_seed(10 * rank + micro))
        loss = next_token_loss(model(tokens[:, :-1]), tokens[:, 1:]) / MICRO
        sync.begin_backward()
        if micro < MICRO - 1:
            with sync.no_sync():
                loss.backward()
        else:
            loss.backward()
        sync.end_backward()
        if sharding != "NO_SHARD":
            held.append(held_gradients([model]))
            shaped.append(_shard_shapes_match(model.parameters()))
    sync.finish()
    return {
        "held": held, "shard shaped": shaped,
        "local params": sum(_local(p).numel() for p in model.parameters()),
        "grads": {n: _full(p.grad) for n, p in model.named_parameters()},
    }


def _pipeline(rank: int, world_size: int, sharding: str, defer: bool = False) -> dict:
    torch.manual_seed(0)
    model = MoETransformer(config())
    ctx = build_parallel_context(ParallelDims(world_size, pp=2), "cpu")
    runners: list[PipelineRunner] = []

    def split(module):
        runners.append(PipelineRunner(module, ctx, "1F1B", M, next_token_loss, torch.device("cpu")))
        return runners[0].shard_units()

    prepare_model(model, ctx, torch.device("cpu"), ParallelOptions("alltoall", sharding), split=split)
    sync = _sync(model, ctx, sharding, defer)
    set_aux_loss_scale(model, 1.0)
    held, shaped = [], []
    backward = PipelineStage.backward_one_chunk

    def observed(stage, *args, **kwargs):
        result = backward(stage, *args, **kwargs)
        held.append(held_gradients(runners[0].modules))
        shaped.append(_shard_shapes_match(model.parameters()))
        return result

    tokens = torch.randint(0, 64, (2 * M, SEQ + 1), generator=torch.Generator().manual_seed(10 + ctx.rank_in("dp")))
    with mock.patch.object(PipelineStage, "backward_one_chunk", observed):
        runners[0].step(tokens[:, :-1], tokens[:, 1:], sync)
    return {
        "held": held if sharding != "NO_SHARD" else [], "shard shaped": shaped,
        "local params": sum(_local(p).numel() for p in model.parameters()),
        "grads": {n: _full(p.grad) for n, p in model.named_parameters()},
    }


def _runs(rank: int, world_size: int, defer: bool) -> dict:
    out = {}
    shardings = ("FULL_SHARD",) if defer else ("NO_SHARD", "FULL_SHARD", "SHARD_GRAD_OP")
    for sharding in shardings:
        out[("accumulate", sharding)] = _accumulate(rank, world_size, sharding, defer)
        out[("pipeline", sharding)] = _pipeline(rank, world_size, sharding, defer)
    return out


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory):
    return run_distributed(_runs, WORLD, False, timeout_s=240, tmp_dir=tmp_path_factory.mktemp("grad_memory"))


@pytest.fixture(scope="module")
def deferred_runs(tmp_path_factory):
    return run_distributed(_runs, WORLD, True, timeout_s=240, tmp_dir=tmp_path_factory.mktemp("grad_memory_deferred"))


def _check_grads(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   msg=lambda m, n=name: f"{what} {n}: {m}")


KINDS = ["accumulate", "pipeline"]
DIMS = {"accumulate": ParallelDims(WORLD, ep=2, etp=1), "pipeline": ParallelDims(WORLD, pp=2)}


def _formula(kind: str, rank: int, fsdp: bool) -> int:
    """Parameter elements of ``rank`` from the config (``scale.formula``), its pipeline stage's under PP."""
    dims = DIMS[kind]
    if kind == "accumulate":
        return local_parameters(config(), dims, fsdp=fsdp)
    stage, half = dims.coords(rank).pp, config().num_layers // 2
    return local_parameters(config(), dims, fsdp=fsdp, layers=range(stage * half, (stage + 1) * half),
                            first=stage == 0, last=stage == 1)


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_micro_batch_leaves_only_gradient_shards(default_runs, kind, sharding):
    for rank, runs in enumerate(default_runs):
        got, replicated = runs[(kind, sharding)], runs[(kind, "NO_SHARD")]
        shard = got["local params"]
        assert (shard, replicated["local params"]) == (_formula(kind, rank, True), _formula(kind, rank, False)), rank
        assert len(got["held"]) == (MICRO if kind == "accumulate" else M), rank
        for micro, held in enumerate(got["held"]):
            assert held == {"sharded": shard, "unsharded": 0}, (
                f"rank {rank}, micro-batch {micro}: {held['unsharded']} unsharded gradient elements held "
                f"({held['unsharded'] / shard:.1f}x the {shard}-element shard)"
            )
        assert all(got["shard shaped"]), (rank, got["shard shaped"])
        _check_grads(got["grads"], replicated["grads"], f"rank {rank} {kind} {sharding}")


@pytest.mark.parametrize("kind", KINDS)
def test_deferred_reduction_holds_unsharded_gradients_until_the_step(default_runs, deferred_runs, kind):
    for rank, (runs, replicated) in enumerate(zip(deferred_runs, default_runs)):
        got, oracle = runs[(kind, "FULL_SHARD")], replicated[(kind, "NO_SHARD")]
        unsharded = oracle["local params"]  # what one rank holds of every parameter without sharding
        *before, last = got["held"]
        for micro, held in enumerate(before):
            assert held == {"sharded": 0, "unsharded": unsharded}, (rank, micro, held)
        if kind == "accumulate":  # the synchronised last backward reduced them
            assert last == {"sharded": got["local params"], "unsharded": 0}, (rank, last)
        else:  # the schedule's last backward is deferred too: reduced after the schedule
            assert last == {"sharded": 0, "unsharded": unsharded}, (rank, last)
        _check_grads(got["grads"], oracle["grads"], f"rank {rank} {kind} deferred")
