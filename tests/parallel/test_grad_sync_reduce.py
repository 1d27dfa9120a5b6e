"""GradSync's reduction: in fp32 for narrower parameters (precision against an fp64 oracle), the
transient that costs (at most two buckets in fp32), and what the gradient path allocates and copies.

What the CPU cannot show: on NCCL the bf16 ring sum rounds once per hop as gloo's does here, and
waiting for an older fp32 bucket makes the compute stream wait for that reduction (a GPU run
measures whether backward still overlaps; see benchmarks/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_moe import GroupedExperts, MoEConfig
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims, build_parallel_context, is_expert_param, parallelize
from lightning_moe.parallel.grad_sync import GradSync

pytestmark = pytest.mark.distributed

N = 4096  # elements: enough that a bf16 ring sum of four ranks rounds differently somewhere


class _Vector(nn.Module):
    def __init__(self, n: int = N, parts: int = 1) -> None:
        super().__init__()
        self.parts = nn.ParameterList(nn.Parameter(torch.zeros(n // parts, dtype=torch.bfloat16)) for _ in range(parts))

    def loss(self, values: torch.Tensor) -> torch.Tensor:
        """Its gradient is ``values`` exactly (a product with ones in bf16)."""
        return sum((p * v).sum() for p, v in zip(self.parts, values.chunk(len(self.parts))))


def _values(rank: int) -> torch.Tensor:
    # In [1, 2): four of them sum exactly in fp32, so an fp32 reduction rounds only once, to bf16.
    return (torch.rand(N, generator=torch.Generator().manual_seed(rank)) + 1).to(torch.bfloat16)


def _reduced(rank: int, world: int, **options) -> torch.Tensor:
    model = _Vector()
    sync = GradSync(model, build_parallel_context(ParallelDims(world), "cpu"), **options)
    model.loss(_values(rank)).backward()
    sync.finish()
    return model.parts[0].grad.detach().clone()


def _both_reductions(rank: int, world: int) -> dict[str, torch.Tensor]:
    return {"default": _reduced(rank, world), "bf16": _reduced(rank, world, grad_reduce_in_fp32=False)}


def test_bf16_gradients_are_reduced_in_fp32_by_default(tmp_path):
    """Pure DP=4 on bf16 parameters: the default reduction gives the fp64 mean rounded once to bf16
    (every element); reducing in bf16 (``grad_reduce_in_fp32=False``) misses it on many elements."""
    exact = sum(_values(r).double() for r in range(4)) / 4
    want = exact.to(torch.bfloat16)
    for rank, got in enumerate(run_distributed(_both_reductions, 4, tmp_dir=tmp_path)):
        wrong = int((got["default"] != want).sum())
        assert wrong == 0, f"rank {rank}: {wrong} of {N} elements differ from the fp64 mean rounded to bf16"
        assert got["default"].dtype == torch.bfloat16
        bf16_error = (got["bf16"].double() - exact).abs().max()
        assert int((got["bf16"] != want).sum()) > N // 20 and bf16_error > (got["default"].double() - exact).abs().max()


def _fp32_buckets_alive(rank: int, world: int) -> list[int]:
    """At each all-reduce of the 8 one-parameter buckets: how many fp32 copies GradSync still holds.

    Counted from the buckets (each fp32 copy hangs on its bucket until rounded back), not through
    weak references to the tensors: after ``wait()`` returns, gloo's worker thread may still hold
    the finished work, and with it the tensor, for a moment, which a weak reference would count."""
    model = _Vector(parts=8)
    sync = GradSync(model, build_parallel_context(ParallelDims(world), "cpu"), bucket_size_mb=1e-4)
    assert len(sync.buckets) == 8
    counts: list[int] = []
    real = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        held = [b.staging for b in sync.buckets if b.staging is not None]
        assert any(t is tensor for t in held), "the all-reduce does not sum the bucket's fp32 copy"
        counts.append(len(held))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        model.loss(_values(rank)).backward()
        sync.finish()
    finally:
        dist.all_reduce = real
    assert all(b.staging is None for b in sync.buckets), "an fp32 copy outlived finish()"
    return counts


def test_fp32_reduction_holds_at_most_two_buckets_in_fp32(tmp_path):
    for counts in run_distributed(_fp32_buckets_alive, 2, tmp_dir=tmp_path):
        assert len(counts) == 8 and max(counts) == 2, counts


class _GradientPath(TorchDispatchMode):
    """Counts copies and the ops that return new storage (allocations) inside GradSync."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0
        self.allocations: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.copies += name == "copy_"
        self.allocations += [name for t in outputs if t.untyped_storage().data_ptr() not in inputs]
        return out


def _gradient_path(rank: int, world: int) -> list[tuple[int, list[str], int]]:
    """Per step (after the buckets exist): copies, allocations, parameters with a gradient."""
    torch.manual_seed(0)
    config = MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2,
        ffn_hidden_size=64, first_dense_layers=1, moe=MoEConfig(32, 16, 8, top_k=2),
    )
    model = MoETransformer(config)
    ctx = build_parallel_context(ParallelDims(world, tp=2, etp=1, ep=2), "cpu")
    parallelize(model, ctx)
    sync = GradSync(model, ctx, bucket_size_mb=0.01)
    counter = _GradientPath()
    hook, finish = sync._on_grad_ready, sync.finish
    for handle in sync._hooks:
        handle.remove()

    def counted_hook(param):
        with counter:
            hook(param)

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(counted_hook)
    steps = []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        counter.copies, counter.allocations = 0, []
        tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(step))
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        with counter:
            finish()
        landed = sum(p.grad is not None and not is_expert_param(p) for p in model.parameters())
        steps.append((counter.copies, counter.allocations, landed))
    buffers = [(b.buffer.data_ptr(), b.buffer.data_ptr() + b.buffer.nbytes) for b in sync.buckets]
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    # Where each expert weight gradient and its kernel's reused gradient memory live: in a bucket, or elsewhere.
    places = [(name, any(a <= t.data_ptr() < b for a, b in buffers))
              for m in experts for name, t in [("grad", m.fc1_weight.grad), ("grad", m.fc2_weight.grad),
                                               *m.grad_workspace._storage.items()]]
    sync.remove_hooks()  # a GradSync let go of: the kernels no longer write into (or keep) its buckets
    places += [("after remove_hooks", not any(a <= t.data_ptr() < b for a, b in buffers))
               for m in experts for t in m.grad_workspace._storage.values()]
    return steps[1:], places  # the first step allocates the buckets


def test_the_gradient_path_lands_each_gradient_with_one_copy_and_allocates_nothing(tmp_path):
    """TP=2 (DTensor gradients: sharded, Partial norms, and the vocab-parallel embedding's gradient
    of its own rows) after zero_grad(set_to_none=True): each gradient is copied once into
    its slot, the only way into a flat buffer for a gradient that autograd allocated, and nothing
    else is allocated: no temporary of a redistribution, no scaled copy. The expert kernel writes
    the expert weight gradients straight into their slots (no copy), and the memory it reuses
    across steps is those slots: no second copy of the expert gradients is kept."""
    for rank, (steps, places) in enumerate(run_distributed(_gradient_path, 2, tmp_dir=tmp_path)):
        for copies, allocations, landed in steps:
            assert allocations == [] and copies == landed, (rank, copies, landed, allocations)
        assert places and all(in_bucket for _, in_bucket in places), (rank, places)
