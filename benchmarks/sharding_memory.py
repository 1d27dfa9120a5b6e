"""Per-rank bytes of parameters, gradients and AdamW state under each sharding strategy (``memory.py --sharding``).

On 4 forked gloo CPU ranks (``tests/helpers/dist.py::run_distributed``), for (TP, EP, ETP) in
(1, 2, 1), (1, 4, 1), (2, 2, 1), a reference ``MoETransformer`` is parallelized with
``sharding_strategy`` ``NO_SHARD``, ``SHARD_GRAD_OP`` and ``FULL_SHARD`` and takes one AdamW step
(fp32). Counted exactly on rank 0 after the step: the local storage of every parameter, gradient
and optimizer moment (a DTensor's local shard), split into dense and expert tensors.

Prediction (README, "Sharded data parallelism"): a sharded rank holds its ``NO_SHARD`` dense bytes
divided by the dense data-parallel size ``DP * CP`` and its expert bytes divided by ``EDP``, up to
FSDP2's rounding (dimension 0 of a dense tensor is split in ``ceil`` chunks). ``SHARD_GRAD_OP`` and
``FULL_SHARD`` hold the same state between steps; they differ in what is gathered during the step
(``SHARD_GRAD_OP`` keeps each unit's full parameters from its forward to its backward).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))  # helpers

from helpers.dist import run_distributed
from torch.distributed.tensor import DTensor

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import (
    ParallelDims,
    ShardedGradSync,
    build_parallel_context,
    is_expert_param,
    parallelize,
)
from lightning_moe.parallel.grad_sync import GradSync

WORLD = 4
LAYOUTS = [(1, 2, 1), (1, 4, 1), (2, 2, 1)]
STRATEGIES = ["NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"]
KINDS = ("params", "grads", "optimizer")


def _config() -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=512, hidden_size=128, num_layers=4, num_attention_heads=8, num_kv_heads=4, ffn_hidden_size=256,
        first_dense_layers=1, max_seq_len=64,
        moe=MoEConfig(128, 64, 16, top_k=4, shared_expert_ffn_hidden_size=64),
    )


def _bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _measure(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    results = {}
    for tp, ep, etp in LAYOUTS:
        ctx = build_parallel_context(ParallelDims(world_size, tp=tp, ep=ep, etp=etp), "cpu")
        for strategy in STRATEGIES:
            torch.manual_seed(0)
            model = parallelize(MoETransformer(_config()), ctx, sharding_strategy=strategy)
            sync = GradSync(model, ctx) if strategy == "NO_SHARD" else ShardedGradSync(model, ctx)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(ctx.rank_in("dp")))
            sync.begin_backward()
            model.loss(tokens[:, :-1], tokens[:, 1:]).backward()  # vocabulary-parallel at TP > 1
            sync.end_backward()
            sync.finish()
            optimizer.step()
            sizes = {kind: {"dense": 0, "expert": 0} for kind in KINDS}
            rows = {"dense": 0, "expert": 0}
            for p in model.parameters():
                side = "expert" if is_expert_param(p) else "dense"
                sizes["params"][side] += _bytes(p)
                sizes["grads"][side] += _bytes(p.grad) if p.grad is not None else 0
                state = optimizer.state[p]
                sizes["optimizer"][side] += sum(_bytes(v) for v in state.values() if torch.is_tensor(v) and v.dim())
                local = p.to_local() if isinstance(p, DTensor) else p
                rows[side] += local[0].numel() * local.element_size() if local.dim() else 0
            results[((tp, ep, etp), strategy)] = {
                "sizes": sizes, "rows": rows, "dp_cp": ctx.size("dp_cp"), "edp": ctx.size("edp"),
            }
    return results


def sharding_table() -> str:
    """The markdown table of rank 0's bytes, measured and predicted, per layout and strategy."""
    rank0 = run_distributed(_measure, WORLD, timeout_s=600)[0]
    mb = 1 / 2**20
    lines = [
        "| TP, EP, ETP | DP x CP | EDP | strategy | params MB | grads MB | AdamW MB | total MB | predicted MB "
        "| vs NO_SHARD |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layout in LAYOUTS:
        base = rank0[(layout, "NO_SHARD")]
        base_total = sum(sum(base["sizes"][k].values()) for k in KINDS)
        for strategy in STRATEGIES:
            run = rank0[(layout, strategy)]
            total = sum(sum(run["sizes"][k].values()) for k in KINDS)
            if strategy == "NO_SHARD":
                predicted = base_total
            else:
                predicted = sum(base["sizes"][k]["dense"] / run["dp_cp"] + base["sizes"][k]["expert"] / run["edp"]
                                for k in KINDS)
                allowance = 4 * (run["rows"]["dense"] + run["rows"]["expert"])  # one row per tensor, 4 copies
                assert abs(total - predicted) <= allowance, (layout, strategy, total, predicted, allowance)
            cells = [f"{sum(run['sizes'][k].values()) * mb:.3f}" for k in KINDS]
            lines.append(
                f"| {', '.join(map(str, layout))} | {run['dp_cp']} | {run['edp']} | {strategy} | {' | '.join(cells)} "
                f"| {total * mb:.3f} | {predicted * mb:.3f} | {total / base_total:.3f}x |"
            )
    return "\n".join(lines)
