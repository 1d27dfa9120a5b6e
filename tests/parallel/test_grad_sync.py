"""GradSync details beyond the parity tests: reduced gradients against an oracle with and without
accumulation, ``zero_grad(set_to_none=True/False)``, TP DTensors, idempotent finish, several backward
passes per step, parameters without gradients, buckets of mixed dtypes, gradients living in the
persistent bucket buffers, no host reads of the flags, and backward passes outside an armed step.

Oracles: the single-device model on the global batch (MoE transformer layouts), or the sum of every
rank's gradient times ``1 / DP`` computed on one process (small dense models)."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from helpers.asserts import assert_close_to_scale
from helpers.dist import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims, build_parallel_context, expert_shard, parallelize
from lightning_moe.parallel.expert_parallel import _local_slice
from lightning_moe.parallel.grad_sync import GradSync

pytestmark = pytest.mark.distributed

GRAD_RTOL = 1e-5  # fp32, reductions in another order than one device (relative to the largest entry)


def _config() -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2,
        ffn_hidden_size=64, first_dense_layers=1, moe=MoEConfig(32, 16, 8, top_k=2),
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _assert_grads_equal_reference(model: nn.Module, reference: nn.Module, where: str) -> None:
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        got, want = param.grad, ref[name].grad
        assert got is not None and want is not None, f"{where}: {name} has no gradient"
        if isinstance(got, DTensor):
            assert got.placements == param.placements, f"{where}: {name} {got.placements} != {param.placements}"
            got = got.full_tensor()
        elif expert_shard(param) is not None:
            want = _local_slice(want, expert_shard(param), param.shape[0])
        assert_close_to_scale(got, want, GRAD_RTOL, f"{where}: {name}")


def _assert_grads_equal(model, want: dict, step: int) -> None:
    """Every gradient equals the oracle's; None where no rank produced one."""
    for name, param in model.named_parameters():
        if want[name] is None:
            assert param.grad is None, f"step {step}: {name} got a gradient no rank produced"
        else:
            assert_close_to_scale(param.grad, want[name], GRAD_RTOL, f"step {step}: {name}")


def _assert_grads_live_in_buckets(sync: GradSync, where: str) -> dict[int, int]:
    """Every gradient is a view into its bucket's buffer; returns id(param) -> local data_ptr."""
    pointers = {}
    for i, bucket in enumerate(sync.buckets):
        storages = {_local(p.grad).untyped_storage().data_ptr() for p in bucket.params if p.grad is not None}
        if not storages:
            continue  # no gradient in this bucket (parameters no rank used)
        assert len(storages) == 1, f"{where}: bucket {i} gradients live in {len(storages)} storages, not one"
        assert storages == {bucket.buffer.untyped_storage().data_ptr()}, f"{where}: bucket {i} not its buffer"
        pointers.update({id(p): _local(p.grad).data_ptr() for p in bucket.params if p.grad is not None})
    return pointers


def _steps_against_single_device(rank: int, world: int, layout: dict) -> None:
    """Two steps for every (set_to_none, micro-batches) pair; gradients equal the single-device run."""
    dims = ParallelDims(world, **layout)
    ctx = build_parallel_context(dims, "cpu")
    dp, dp_rank = ctx.size("dp"), ctx.rank_in("dp")
    for set_to_none in (True, False):
        for micro_batches in (1, 2):
            torch.manual_seed(0)
            reference = MoETransformer(_config())
            model = copy.deepcopy(reference)
            parallelize(model, ctx)
            sync = GradSync(model, ctx, bucket_size_mb=0.01)  # several buckets
            pointers = None
            for step in range(2):
                where = f"set_to_none={set_to_none}, micro_batches={micro_batches}, step {step}"
                model.zero_grad(set_to_none=set_to_none)
                reference.zero_grad(set_to_none=set_to_none)
                for micro in range(micro_batches):
                    gen = torch.Generator().manual_seed(10 * step + micro)
                    tokens = torch.randint(0, 64, (2 * dp, 9), generator=gen)
                    mine = tokens[dp_rank * 2 : (dp_rank + 1) * 2]
                    last = micro == micro_batches - 1
                    with nullcontext() if last else sync.no_sync():
                        (model.loss(mine[:, :-1], mine[:, 1:]) / micro_batches).backward()
                    (reference.loss(tokens[:, :-1], tokens[:, 1:]) / micro_batches).backward()
                sync.finish()
                _assert_grads_equal_reference(model, reference, where)
                now = _assert_grads_live_in_buckets(sync, where)
                assert pointers is None or now == pointers, f"{where}: gradients moved to other memory"
                pointers = now
            sync.remove_hooks()


@pytest.mark.parametrize(
    ("world", "layout"),
    [(2, {"ep": 2}), (2, {"tp": 2, "etp": 1, "ep": 2}), (4, {"tp": 2, "etp": 1, "ep": 2})],
    ids=["ep2", "tp2-ep2", "tp2-dp2-ep2-edp2"],
)
def test_reduced_gradients_equal_single_device_in_persistent_buckets(world, layout, tmp_path):
    # tp2: DTensor parameters (sharded, and sequence-parallel norms whose gradients arrive Partial);
    # the 4-rank layout has every reduction group (tp_dp_cp, dp_cp, edp) larger than one rank.
    run_distributed(_steps_against_single_device, world, layout, timeout_s=240, tmp_dir=tmp_path)


def _backward_passes(rank: int, world: int, layout: dict, overlap: bool, passes: int) -> None:
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
    _assert_grads_equal_reference(model, reference, f"overlap={overlap}, passes={passes}")


@pytest.mark.parametrize("layout", [{"ep": 2}, {"tp": 2, "etp": 1, "ep": 2}], ids=["ep2", "tp2-ep2"])
def test_finish_is_idempotent_and_manual_accumulation_reduces_once(layout, tmp_path):
    # Automatic optimization: one backward overlapped with the reduction, then finish (twice: the
    # second is a no-op). Manual optimization: two backward passes, one reduction at the step.
    for overlap, passes in ((True, 1), (False, 2)):
        run_distributed(_backward_passes, 2, layout, overlap, passes, tmp_dir=tmp_path)


class _Heads(nn.Module):
    def __init__(self, dtype_b: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.rank0_only = nn.Linear(4, 4)  # a gradient on rank 0 only: the flags must say "some rank had one"
        self.unused = nn.Linear(4, 4).to(dtype_b)

    def loss(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        out = self.used(x)
        if rank == 0:
            out = self.rank0_only(out)
        return out.pow(2).sum()


def _inputs(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _oracle(model: nn.Module, world: int, step: int) -> dict[str, torch.Tensor | None]:
    """Sum over ranks of each rank's gradient, times 1 / DP, on this process alone."""
    reference = copy.deepcopy(model)
    reference.zero_grad(set_to_none=True)
    for r in range(world):
        (reference.loss(_inputs(r, step), r) / world).backward()
    return {name: None if p.grad is None else p.grad.clone() for name, p in reference.named_parameters()}


def _unused_and_mixed_dtypes(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = _Heads(torch.bfloat16)
    ctx = build_parallel_context(ParallelDims(world), "cpu")
    sync = GradSync(model, ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = model.unused.weight.detach().clone()
    for step, set_to_none in enumerate((True, False, True)):
        optimizer.zero_grad(set_to_none=set_to_none)
        want = _oracle(model, world, step)
        model.loss(_inputs(rank, step), rank).backward()
        sync.finish()
        _assert_grads_equal(model, want, step)
        _assert_grads_live_in_buckets(sync, f"step {step}")
        optimizer.step()
    return {
        "unused_unchanged": torch.equal(model.unused.weight, before),
        "buckets": sorted({(b.group_name, str(b.dtype)) for b in sync.buckets}),
    }


def test_parameters_without_gradients_keep_none_and_dtypes_do_not_mix(tmp_path):
    for result in run_distributed(_unused_and_mixed_dtypes, 2, tmp_dir=tmp_path):
        assert result["unused_unchanged"], result
        assert result["buckets"] == [("tp_dp_cp", "torch.bfloat16"), ("tp_dp_cp", "torch.float32")]


class _HostTransfers:
    """Counts device->host reads (tolist, item, cpu) and host->device tensors (torch.tensor)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, owner: object, name: str) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))

        def counting(*args, **kwargs):
            self.calls.append(name)
            return original(*args, **kwargs)

        setattr(owner, name, counting)

    def __enter__(self) -> _HostTransfers:
        for name in ("tolist", "item", "cpu"):
            self._wrap(torch.Tensor, name)
        self._wrap(torch, "tensor")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)


class _Dense(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))

    def loss(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        return self(x).pow(2).sum()


def _host_transfers_of_a_step(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = _Dense()
    ctx = build_parallel_context(ParallelDims(world), "cpu")
    sync = GradSync(model, ctx, bucket_size_mb=1e-4)  # one bucket per parameter
    counts = []
    for step in range(2):
        want = _oracle(model, world, step)
        model.zero_grad(set_to_none=True)
        x = _inputs(rank, step)
        with _HostTransfers() as transfers:
            model.loss(x, rank).backward()
            sync.finish()
        counts.append(transfers.calls)
        for name, param in model.named_parameters():
            assert_close_to_scale(param.grad, want[name], GRAD_RTOL, f"step {step}: {name}")
    return {"buckets": len(sync.buckets), "transfers": counts}


def test_no_host_transfers_when_every_parameter_has_a_gradient(tmp_path):
    # On a GPU each of these is a synchronising copy (flags sent per launch, read per bucket).
    for result in run_distributed(_host_transfers_of_a_step, 2, tmp_dir=tmp_path):
        assert result["buckets"] == 4, result
        assert result["transfers"] == [[], []], result


def _backward_outside_the_step(rank: int, world: int, set_to_none: bool) -> None:
    torch.manual_seed(0)
    model = _Heads()
    ctx = build_parallel_context(ParallelDims(world), "cpu")
    sync = GradSync(model, ctx, bucket_size_mb=1e-4, explicit_backward=True)
    launched: list[int] = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        launched.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        for step in range(3):
            # A callback's probe (or a validation step under enable_grad) on rank 0 only, between
            # steps: it must neither mark buckets nor launch collectives nor make finish reduce.
            if rank == 0:
                with torch.enable_grad():
                    model.loss(torch.ones(2, 4) * (step + 1), 0).backward()
                sync.finish()
            assert launched == [], f"step {step}: an unarmed backward launched {launched}"
            want = _oracle(model, world, step)
            model.zero_grad(set_to_none=set_to_none)
            sync.begin_backward()
            model.loss(_inputs(rank, step), rank).backward()
            sync.end_backward()
            sync.finish()
            assert len(launched) == len(sync.buckets), f"step {step}: {len(launched)} all-reduces"
            launched.clear()
            _assert_grads_equal(model, want, step)
    finally:
        dist.all_reduce = all_reduce


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
def test_backward_outside_an_armed_step_does_not_leak_into_the_next_reduction(set_to_none, tmp_path):
    run_distributed(_backward_outside_the_step, 2, set_to_none, tmp_dir=tmp_path)


@pytest.mark.gpu
def test_backward_and_finish_do_not_synchronise_the_device():
    # Two fake ranks (collectives are no-ops): what is measured is this rank's host<->device traffic.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).cuda().to(torch.bfloat16)
        sync = GradSync(model, build_parallel_context(ParallelDims(2), "cuda"), bucket_size_mb=0.01)
        x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
        model(x).float().pow(2).sum().backward()  # warm-up: allocates the bucket buffers
        sync.finish()
        for set_to_none in (True, False):
            model.zero_grad(set_to_none=set_to_none)
            loss = model(x).float().pow(2).sum()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss.backward()
                sync.finish()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            for bucket in sync.buckets:
                for p in bucket.params:
                    assert p.grad.dtype == torch.bfloat16 and p.grad.is_cuda
                    assert p.grad.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()
    finally:
        dist.destroy_process_group()
