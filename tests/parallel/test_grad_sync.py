"""GradSync details beyond the parity tests: idempotent finish, several backward passes per step,
parameters without gradients, buckets of mixed dtypes. Oracle: the single-device gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.dist import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims, build_parallel_context, expert_shard, parallelize
from lightning_moe.parallel.expert_parallel import _local_slice
from lightning_moe.parallel.grad_sync import GradSync

pytestmark = pytest.mark.distributed

GRAD_RTOL = 1e-5  # fp32, reductions in another order than one device


def _config() -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2,
        ffn_hidden_size=64, first_dense_layers=1, moe=MoEConfig(32, 16, 8, top_k=2),
    )


def _worst_error(model: nn.Module, reference: nn.Module) -> float:
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, param in model.named_parameters():
        got, want = param.grad, ref[name].grad
        if isinstance(got, DTensor):
            got = got.full_tensor()
        elif expert_shard(param) is not None:
            want = _local_slice(want, expert_shard(param), param.shape[0])
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return worst


def _backward_passes(rank: int, world: int, layout: dict, overlap: bool, passes: int) -> float:
    torch.manual_seed(0)
    reference = MoETransformer(_config())
    model = copy.deepcopy(reference)
    ctx = build_parallel_context(ParallelDims(world, **layout), "cpu")
    parallelize(model, ctx)
    sync = GradSync(model, ctx, bucket_size_mb=0.01, overlap=overlap)
    dp, dp_rank = ctx.size("dp"), ctx.rank_in("dp")
    batches = [torch.randint(0, 64, (2 * dp, 9), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    for tokens in batches[:passes]:
        mine = tokens[dp_rank * 2 : (dp_rank + 1) * 2]
        model.loss(mine[:, :-1], mine[:, 1:]).backward()
        reference.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    sync.finish()
    sync.finish()  # idempotent: nothing new arrived
    return _worst_error(model, reference)


@pytest.mark.parametrize("layout", [{"ep": 2}, {"tp": 2, "etp": 1, "ep": 2}], ids=["ep2", "tp2-ep2"])
def test_finish_is_idempotent_and_manual_accumulation_reduces_once(layout, tmp_path):
    # Automatic optimization: one backward overlapped with the reduction, then finish (twice: the
    # second is a no-op). Manual optimization: two backward passes, one reduction at the step.
    for overlap, passes in ((True, 1), (False, 2)):
        errors = run_distributed(_backward_passes, 2, layout, overlap, passes, tmp_dir=tmp_path)
        assert max(errors) < GRAD_RTOL, (overlap, passes, errors)


class _TwoHeads(nn.Module):
    def __init__(self, dtype_b: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4).to(dtype_b)


def _unused_and_mixed_dtypes(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = _TwoHeads(torch.bfloat16)
    ctx = build_parallel_context(ParallelDims(world), "cpu")
    sync = GradSync(model, ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = model.unused.weight.detach().clone()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    model.used(x).sum().backward()
    sync.finish()
    optimizer.step()
    return {
        "unused_grad_is_none": model.unused.weight.grad is None,
        "unused_unchanged": torch.equal(model.unused.weight, before),
        "buckets": sorted({(b.group_name, str(b.dtype)) for b in sync.buckets}),
    }


def test_parameters_without_gradients_keep_none_and_dtypes_do_not_mix(tmp_path):
    for result in run_distributed(_unused_and_mixed_dtypes, 2, tmp_dir=tmp_path):
        assert result["unused_grad_is_none"] and result["unused_unchanged"], result
        assert result["buckets"] == [("tp_dp_cp", "torch.bfloat16"), ("tp_dp_cp", "torch.float32")]
