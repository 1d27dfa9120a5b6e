"""A ``MoELayer`` outside the reference model at TP > 1 routes each TP rank's slice of its replicated input.

:func:`~lightning_moe.parallel.user_tensor_parallel.split_moe_tokens`, applied by
:func:`~lightning_moe.parallel.parallelize` at TP=2 (ETP=2, two forked gloo ranks). Oracle: the same
layer on one device, on the same (replicated) input: its output, the input's gradient and the
router's gradient (each TP rank holds the part of its own tokens: their sum over TP) must equal
the one-device layer's, for a ``[B, S, H]`` input with a padding mask passed by keyword, a
``[T, H]`` input, and a replicated DTensor input (whose output comes back as a DTensor). Errors:
inputs that differ between the TP ranks, a sequence length TP does not divide, and (4 ranks) what
a model's own parallelism may not do: DTensors on the data-parallel dims, its own ``fully_shard``,
a pipeline split.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize
from lightning_moe.parallel.layout.lightning_mesh import lightning_device_mesh
from lightning_moe.parallel.user_tensor_parallel import apply_user_tensor_parallel

pytestmark = pytest.mark.distributed

TOL = 1e-5  # fp32; the TP sums and the ETP reduce-scatter add in another order than one device
HIDDEN = 8


class _Holder(nn.Module):
    """A user model's container for one MoE layer (not the reference transformer)."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = MoELayer(MoEConfig(HIDDEN, 8, 4, top_k=2, init_std=0.2, shared_expert_ffn_hidden_size=8))


def _pair(ctx):
    torch.manual_seed(0)
    reference = _Holder()
    model = parallelize(copy.deepcopy(reference), ctx, tp_replicated_input=True)  # as under MoEStrategy
    return reference, model


def _run(layer: nn.Module, x: torch.Tensor, weight: torch.Tensor, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    out = layer(x, **kwargs)
    full = out.full_tensor() if isinstance(out, DTensor) else out
    (full * weight).sum().backward()
    return full.detach(), x.grad


def _compare(rank: int, world: int) -> dict:
    ctx = build_parallel_context(ParallelDims(world, tp=2), "cpu")
    reference, model = _pair(ctx)
    torch.manual_seed(1)  # the same input on both TP ranks, as between a model's own TP layers
    x3, w3 = torch.randn(2, 4, HIDDEN), torch.randn(2, 4, HIDDEN)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1, 3] = True
    x2, w2 = torch.randn(6, HIDDEN), torch.randn(6, HIDDEN)
    results = {}
    for name, x, w, kwargs in (("bsh_mask", x3, w3, {"padding_mask": mask}), ("flat", x2, w2, {})):
        reference.zero_grad(), model.zero_grad()
        want_out, want_grad = _run(reference.moe, x, w, **kwargs)
        got_out, got_grad = _run(model.moe, x, w, **kwargs)
        router = model.moe.router.weight.grad.clone()
        dist.all_reduce(router, group=ctx.group("tp"))
        results[name] = [(got_out - want_out).abs().max().item(), (got_grad - want_grad).abs().max().item(),
                         (router - reference.moe.router.weight.grad).abs().max().item()]
    # A DTensor input: sliced on its own mesh, its output a DTensor of that mesh.
    tp_mesh = ctx.dense_mesh["tp"]
    out = model.moe(DTensor.from_local(x3, tp_mesh, (Replicate(),), run_check=False))
    results["dtensor"] = [isinstance(out, DTensor), (out.full_tensor() - reference.moe(x3)).abs().max().item()]
    return results


def _errors(rank: int, world: int) -> dict:
    ctx = build_parallel_context(ParallelDims(world, tp=2), "cpu")
    found = {}
    for name, x in (("differ", torch.full((1, 4, HIDDEN), float(rank))), ("length", torch.zeros(1, 3, HIDDEN))):
        _, model = _pair(ctx)
        try:
            model.moe(x)
            found[name] = "no error"
        except ValueError as err:
            found[name] = str(err)
    return found


def test_token_split_equals_the_one_device_layer(tmp_path):
    for result in run_distributed(_compare, 2, timeout_s=120, tmp_dir=tmp_path):
        for name in ("bsh_mask", "flat"):
            assert max(result[name]) < TOL, (name, result[name])  # output, input grad, router grad
        is_dtensor, error = result["dtensor"]
        assert is_dtensor and error < TOL


def test_inputs_it_cannot_split_are_refused(tmp_path):
    for found in run_distributed(_errors, 2, timeout_s=120, tmp_dir=tmp_path):
        assert "MoE layer 'moe' received different plain tensors on the 2 tensor-parallel ranks" in found["differ"]
        assert "must stay a DTensor (use_local_output=False" in found["differ"]
        assert ("MoE layer 'moe': the sequence length 3 of its input (1, 3, 8) is not divisible by the tensor "
                "parallel size 2") in found["length"]


def _refusals(rank: int, world: int) -> dict:
    found = {}
    pipeline = build_parallel_context(ParallelDims(world, tp=2, pp=2), "cpu")
    dense = build_parallel_context(ParallelDims(world, tp=2), "cpu")
    two_d = _Holder()
    mesh = lightning_device_mesh(dense)["data_parallel", "tensor_parallel"]
    weight = two_d.moe.router.weight
    two_d.moe.router.weight = nn.Parameter(distribute_tensor(weight.detach(), mesh, (Replicate(), Replicate())))
    sharded = _Holder()
    fully_shard(sharded, mesh=dense.dense_mesh["dp"])
    for name, model, ctx in (("pipeline", _Holder(), pipeline), ("two_d", two_d, dense), ("fsdp", sharded, dense)):
        try:
            apply_user_tensor_parallel(model, ctx, replicated_input=True)  # as under MoEStrategy
            found[name] = "no error"
        except ValueError as err:
            found[name] = str(err)
    return found


def test_what_a_models_own_parallelism_may_not_do_is_refused(tmp_path):
    for found in run_distributed(_refusals, 4, timeout_s=120, tmp_dir=tmp_path):
        assert found["pipeline"].startswith(
            "tensor_parallel_size=2 with pipeline_parallel_size=2 needs a model whose parallel_plan() declares "
            "tensor_parallel"), found
        assert ("moe.router.weight is a DTensor on the mesh dims ('data_parallel', 'tensor_parallel'); a model's own "
                "tensor parallelism under MoEStrategy uses self.device_mesh['tensor_parallel'] alone") in found["two_d"]
        assert "was sharded with fully_shard before MoEStrategy set it up" in found["fsdp"], found
