"""GPT-OSS's MoE settings (router bias, fc1 bias, clamped SwiGLU, fc2 bias) under EP and ETP.

Each rank builds the one-device layer from a seed (biases made non-zero), parallelises a copy and
runs its own tokens; the oracle is the one-device layer on the gathered batch
(:mod:`parallel.ep_oracles`). Compared: output rows, input gradient, router gradients summed over
all ranks, expert gradients summed over expert-DP against the rank's block of the one-device
gradients (the fc1 bias ``[E, 2, F]`` cut on F like fc1's gate and up rows; the fc2 bias ``[E, H]``
whole on every ETP rank, which only ETP rank 0 adds to its partial output), and the state dict's
global fc1 and fc2 biases. Dispatcher: all-to-all, and at ETP2 x EP2 also allgather and flex (each
sums the ETP ranks' partial outputs its own way). Under ``FULL_SHARD`` (FSDP2) the gradients come reduced over the
data-parallel ranks and divided by their number: multiplied back, they are compared the same way.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed
from parallel.ep_oracles import (
    FP32_GRAD_TOL,
    FP32_OUT_TOL,
    INIT_STD,
    build_reference,
    compare,
    expert_block,
    layer_grads,
    make_tokens,
    run_reference,
    split_rows,
)
from torch.distributed.tensor import DTensor

from lightning_moe.layers.config import MoEConfig
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize

pytestmark = pytest.mark.distributed

HIDDEN, FFN, NUM_EXPERTS, TOP_K = 16, 8, 8, 2
TOKENS = {2: (5, 9), 4: (5, 9, 4, 7)}
LAYOUTS = {  # name: (world, layout, sharding strategy, dispatcher)
    "ep2": (2, {"ep": 2}, "NO_SHARD", "alltoall"),
    "ep4": (4, {"ep": 4}, "NO_SHARD", "alltoall"),
    "etp2": (2, {"ep": 1, "etp": 2}, "NO_SHARD", "alltoall"),
    "etp2-ep2": (4, {"ep": 2, "etp": 2}, "NO_SHARD", "alltoall"),
    "etp2-ep2-allgather": (4, {"ep": 2, "etp": 2}, "NO_SHARD", "allgather"),
    "etp2-ep2-flex": (4, {"ep": 2, "etp": 2}, "NO_SHARD", "flex"),
    "etp2-full-shard": (2, {"ep": 1, "etp": 2}, "FULL_SHARD", "alltoall"),
    "etp2-ep2-full-shard": (4, {"ep": 2, "etp": 2}, "FULL_SHARD", "alltoall"),
}
LIMIT = 0.8  # small enough that the clamps act on some features at INIT_STD
LAUNCH_TIMEOUT_S = 120.0


def _config() -> MoEConfig:
    return MoEConfig(
        hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=NUM_EXPERTS, top_k=TOP_K, init_std=INIT_STD,
        activation="clamped_swiglu", activation_limit=LIMIT, fc1_bias=True, router_bias=True, fc2_bias=True,
    )


def _bias_block(full: torch.Tensor, ep_rank: int, num_local: int, etp_rank: int, etp_size: int) -> torch.Tensor:
    """The rank's block of the one-device fc1 bias ``[E, 2, F]``: its experts, its F block of each half."""
    experts = full[ep_rank * num_local : (ep_rank + 1) * num_local]
    block = experts.shape[-1] // etp_size
    return experts[..., etp_rank * block : (etp_rank + 1) * block]


def _whole(grad: torch.Tensor) -> torch.Tensor:
    """This rank's gradient block whole: FSDP2's gradient DTensor gathered over its data-parallel mesh."""
    return grad.full_tensor() if isinstance(grad, DTensor) else grad.detach().clone()


def _rank(rank: int, world: int, layout: dict, sharding: str, dispatcher: str, kernels: list[str]) -> list:
    ctx = build_parallel_context(ParallelDims(world, **layout), "cpu")
    ep_size, etp_size = ctx.size("ep"), ctx.size("etp")
    ep_rank, etp_rank = ctx.rank_in("ep"), ctx.rank_in("etp")
    num_local = NUM_EXPERTS // ep_size
    rows = []
    # FSDP2 sums the gradients over the data-parallel ranks (expert-DP for the experts) and divides
    # by the dense data-parallel size; NO_SHARD leaves the local gradients, summed here instead.
    fsdp = sharding != "NO_SHARD"
    scale = ctx.size("dp_cp") if fsdp else 1
    for seed, kernel in enumerate(kernels):
        config = _config()
        ref = build_reference(config, seed)
        gen = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for param in (ref.router.bias, ref.experts.fc1_bias, ref.experts.fc2_bias):
                if param is not None:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
        layer = copy.deepcopy(ref)
        layer.experts.kernel = kernel
        # Inside a container: FSDP2 makes the layer a unit of its own and the container the root.
        model = parallelize(torch.nn.Sequential(layer), ctx, dispatcher=dispatcher, sharding_strategy=sharding)

        counts = TOKENS[world]
        xs = make_tokens([(c,) for c in counts], seed + 1, HIDDEN)
        dys = make_tokens([(c,) for c in counts], seed + 2, HIDDEN)
        x = xs[rank].clone().requires_grad_()
        y = model(x)
        y.backward(dys[rank])
        y_all, gx_all = run_reference(ref, xs, dys)
        ref_grads = layer_grads(ref)

        def close(what, kind, actual, expected, case=kernel):
            result = compare(actual, expected)
            rows.append((case, what, kind, result.err, result.scale))

        close("output", "out", y, split_rows(y_all, list(counts), rank))
        close("input grad", "grad", x.grad, split_rows(gx_all, list(counts), rank))
        for name, param in model[0].named_parameters():
            if name.startswith("experts."):
                short = name.split(".", 1)[1]
                if short == "fc1_bias":
                    expected = _bias_block(ref_grads[name], ep_rank, num_local, etp_rank, etp_size)
                else:
                    gated = short == "fc1_weight"
                    expected = expert_block(ref_grads[name], short, ep_rank, num_local, etp_rank, etp_size, gated)
                summed = _whole(param.grad) * scale
                if not fsdp:
                    dist.all_reduce(summed, group=ctx.group("edp"))
                close(f"{name} grad", "grad", summed, expected)
            else:
                summed = _whole(param.grad) * scale
                if not fsdp:
                    dist.all_reduce(summed)
                close(f"{name} grad", "grad", summed, ref_grads[name])
        state = model[0].state_dict()
        for bias in ("fc1_bias", "fc2_bias"):
            rows.append((kernel, f"state-dict {bias} is global", "exact",
                         bool(torch.equal(state[f"experts.{bias}"].full_tensor(), getattr(ref.experts, bias).detach())),
                         True))
    return rows


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_gpt_oss_moe_matches_single_device(layout_name, tmp_path):
    world, layout, sharding, dispatcher = LAYOUTS[layout_name]
    per_rank = run_distributed(
        _rank, world, layout, sharding, dispatcher, ["loop", "grouped_mm"], timeout_s=LAUNCH_TIMEOUT_S,
        tmp_dir=tmp_path,
    )
    tolerances = {"out": FP32_OUT_TOL, "grad": FP32_GRAD_TOL}
    failures = []
    for rank, rows in enumerate(per_rank):
        for case, what, kind, a, b in rows:
            if kind == "exact" and a != b:
                failures.append(f"{case} | rank {rank} | {what}: got {a}, expected {b}")
            elif kind in tolerances and not a <= tolerances[kind] * max(b, 1e-12 / tolerances[kind]):
                failures.append(f"{case} | rank {rank} | {what}: max error {a:.3g} > {tolerances[kind]:g} x {b:.3g}")
    assert not failures, "\n".join(failures)
