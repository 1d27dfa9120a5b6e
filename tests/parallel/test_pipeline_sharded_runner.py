"""`PipelineRunner` on a model sharded after its trim (FSDP2), without Lightning, in a world of one.

Oracle: the same runner on the same (unsharded) model with ``NO_SHARD`` and ``GradSync``. With
``FULL_SHARD`` and ``SHARD_GRAD_OP`` (mp_policy None, fp32), one 1F1B step of ``M=4`` micro-batches
must give the same loss and the same gradient of every parameter at fp32 tolerance: the
reduce-scatters are held off for the schedule and started once after it
(``ShardedGradSync.reduce_accumulated``), then divided by ``M``. On the CPU over gloo (the proxy)
and, marked ``gpu``, on CUDA over NCCL (FSDP2's reduce-scatter stream, torch's private FSDP state
on the GPU machine's torch version), plus a bf16 ``MixedPrecisionPolicy`` within bf16 rounding.
The zero-bubble schedule is refused on sharded stages (its weight-gradient passes run outside
FSDP2's backward hooks).
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers.dist import run_distributed
from parallel.test_pipeline import M, batch, config
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from lightning_moe.layers.loss_scale import set_aux_loss_scale
from lightning_moe.models import MoETransformer
from lightning_moe.models.transformer import next_token_loss
from lightning_moe.parallel import ParallelDims, build_parallel_context
from lightning_moe.parallel.grad_sync import GradSync
from lightning_moe.parallel.options import ParallelOptions
from lightning_moe.parallel.pipeline.runner import PipelineRunner
from lightning_moe.parallel.sharded_grad_sync import ShardedGradSync
from lightning_moe.strategies.model_setup import prepare_model

pytestmark = pytest.mark.distributed


def _step(ctx, device: torch.device, sharding: str, mp_policy=None, schedule: str = "1F1B") -> dict:
    torch.manual_seed(0)
    model = MoETransformer(config())
    runners: list[PipelineRunner] = []

    def split(module):
        runners.append(PipelineRunner(module, ctx, schedule, M, next_token_loss, device))
        return runners[0].shard_units()

    prepare_model(model, ctx, device, ParallelOptions("alltoall", sharding, mp_policy), split=split)
    sync = GradSync(model, ctx, 25.0, explicit_backward=True) if sharding == "NO_SHARD" else ShardedGradSync(model, ctx)
    set_aux_loss_scale(model, 1.0)
    inputs, targets = (t.to(device) for t in batch())
    loss = runners[0].step(inputs, targets, sync)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float().cpu()
             for n, p in model.named_parameters()}
    return {"loss": loss.float().cpu(), "grads": grads, "units": sum(isinstance(m, FSDPModule) for m in model.modules())}


def _runs(rank: int, world_size: int, device_type: str) -> dict:
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    ctx = build_parallel_context(ParallelDims(1, pp=1), device_type)
    out = {s: _step(ctx, device, s) for s in ("NO_SHARD", "FULL_SHARD", "SHARD_GRAD_OP")}
    out["bf16"] = _step(ctx, device, "FULL_SHARD", MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    try:  # its weight-gradient passes run outside FSDP2's hooks: refused before the first step
        _step(ctx, device, "FULL_SHARD", schedule="ZBVZeroBubble")
    except ValueError as err:
        out["zero bubble"] = str(err)
    return out


def _check(result: dict) -> None:
    want = result["NO_SHARD"]
    assert want["units"] == 0
    for sharding, tol in (("FULL_SHARD", 1e-5), ("SHARD_GRAD_OP", 1e-5), ("bf16", 3e-2)):
        got = result[sharding]
        assert got["units"] > 0, sharding
        assert torch.isfinite(got["loss"]), sharding
        torch.testing.assert_close(got["loss"], want["loss"], rtol=tol, atol=tol)
        assert got["grads"].keys() == want["grads"].keys()
        for name, grad in want["grads"].items():
            assert got["grads"][name] is not None and grad is not None, (sharding, name)
            assert torch.isfinite(got["grads"][name]).all(), (sharding, name)
            torch.testing.assert_close(got["grads"][name], grad, rtol=tol, atol=tol * 0.1 if tol < 1e-3 else tol,
                                       msg=lambda m, n=name, s=sharding: f"{s} {n}: {m}")


def test_sharded_runner_equals_replicated_cpu(tmp_path):
    result = run_distributed(_runs, 1, "cpu", timeout_s=120, tmp_dir=tmp_path)[0]
    _check(result)
    assert re.fullmatch(r"PipelineRunner cannot run pipeline_schedule='ZBVZeroBubble' on FSDP2-sharded stages \(.*"
                        r"use '1F1B' or 'Interleaved1F1B', or sharding_strategy='NO_SHARD'\)\.", result.get("zero bubble", ""))


@pytest.mark.gpu
def test_sharded_runner_equals_replicated_cuda(tmp_path):
    _check(run_distributed(_runs, 1, "cuda", backend="nccl", timeout_s=300, tmp_dir=tmp_path)[0])
