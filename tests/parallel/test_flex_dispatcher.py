"""The ``flex`` dispatcher: bytes at the collectives, host reads, helpers, backends.

Parity with the one-device layer on every layout and routing mode (outputs, every gradient,
expert-bias counts, `DispatchStats`, router losses) is in ``test_expert_parallel.py``, where
``flex`` runs every case beside ``alltoall`` and ``allgather``. Here:

* bytes counted at the (wrapped) collectives equal the dedup minimum of ``benchmarks/dispatch.py``
  from the routing maps: dispatch ``D*H*b + A*p``, combine ``D*H*b`` (``D`` (token, remote EP
  rank) pairs, ``A`` remote assignments), plus ``D * ceil(E_local / 8)`` bitmask bytes apart;
  `DispatchStats` and the load metric report the same; backward sends the payload back;
* one host read per dispatch, none in combine (a ``TorchFunctionMode`` count: a CPU proxy, the
  collectives rule out ``FakeTensorMode``); bitmask and expansion helpers against a brute-force
  oracle, and on CUDA without a synchronisation (``gpu``); CPU bf16 autocast numerics;
* CUDA-graph scopes: ``moe_router``'s staged forward runs flex as the layer does; the scopes that
  would capture the dispatch are refused;
* ``flex_backend`` selection and errors; the DeepEP backend on a stand-in ``deep_ep`` (gloo), and
  the real DeepEP against the torch backend (``gpu``: needs ``deep_ep`` and two GPUs).
"""

from __future__ import annotations

import copy
import importlib.machinery
import math
import sys
import types

import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed
from parallel.ep_oracles import (
    FP32_GRAD_TOL,
    FP32_OUT_TOL,
    INIT_STD,
    build_reference,
    make_tokens,
    run_reference,
)
from torch.overrides import TorchFunctionMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_moe.graphs.scopes import check_moe_layer, experts_forward, router_forward
from lightning_moe.layers.config import MoEConfig
from lightning_moe.metrics.load_balance import read_layer_stats
from lightning_moe.parallel import (
    ParallelDims,
    apply_expert_parallel,
    build_parallel_context,
    collectives,
    parallelize,
)
from lightning_moe.parallel.dispatchers import FlexDispatcher, deepep, make_dispatcher
from lightning_moe.parallel.dispatchers.flex import expand_rows, pack_bits, resolve_flex_backend, unpack_bits

HIDDEN, FFN = 16, 8
LAUNCH_TIMEOUT_S = 120.0
# Top-4 of 16 experts (the benchmark's routing): tokens often pick several experts of one rank.
DEDUP = {"num_experts": 16, "top_k": 4}
HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "masked_select", "unique",
              "argwhere", "bincount", "numpy", "cpu"}


def _config(**overrides) -> MoEConfig:
    return MoEConfig(**{"hidden_size": HIDDEN, "ffn_hidden_size": FFN, "num_experts": 8, "top_k": 2,
                        "init_std": INIT_STD, **overrides})


class _HostReads(TorchFunctionMode):
    """Counts calls that copy tensor values to the host (``.tolist()``, ``.item()``, ``bool()``...)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        if name in HOST_READS or (name == "repeat_interleave" and kwargs.get("output_size") is None):
            self.calls.append(name)
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Bytes counted at the collectives, host reads, load metric.


class _WireLog:
    """Wraps the collectives under the dispatchers and logs (phase, dtype, bytes sent to other ranks)."""

    def __init__(self) -> None:
        self.phase, self.entries = "other", []
        a2a, gather = dist.all_to_all_single, collectives._all_gather_flat

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            world, me = dist.get_world_size(group), dist.get_rank(group)
            splits = input_split_sizes or [input.shape[0] // world] * world
            row = math.prod(input.shape[1:]) * input.element_size()
            self.entries.append((self.phase, input.dtype, (sum(splits) - splits[me]) * row))
            return a2a(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

        def all_gather_flat(output, input, group=None, **kw):
            sent = input.numel() * input.element_size() * (dist.get_world_size(group) - 1)
            self.entries.append((self.phase, input.dtype, sent))
            return gather(output, input, group=group, **kw)

        dist.all_to_all_single, collectives._all_gather_flat = all_to_all_single, all_gather_flat

    def wrap(self, dispatcher) -> dict[str, _HostReads]:
        """Tag the collectives of ``dispatcher.dispatch`` / ``combine``; returns their host-read counters."""
        reads = {}
        for name in ("dispatch", "combine"):
            method, reads[name] = getattr(dispatcher, name), _HostReads()

            def run(*args, _method=method, _name=name, **kwargs):
                self.phase = _name
                try:
                    with reads[_name]:
                        return _method(*args, **kwargs)
                finally:
                    self.phase = "other"

            setattr(dispatcher, name, run)
        return reads

    def total(self, phase: str, dtypes: tuple) -> int:
        return sum(sent for p, dtype, sent in self.entries if p == phase and dtype in dtypes)


def _wire_rank(rank: int, world: int, overrides: dict, tokens: tuple[int, ...]) -> dict:
    ctx = build_parallel_context(ParallelDims(world, ep=world), "cpu")
    ref = build_reference(_config(**overrides), seed=3)
    layer = parallelize(copy.deepcopy(ref), ctx, dispatcher="flex")
    assert isinstance(layer.dispatcher, FlexDispatcher)
    x = make_tokens([(t,) for t in tokens], seed=4, hidden=HIDDEN)[rank].requires_grad_()
    log = _WireLog()
    reads = log.wrap(layer.dispatcher)
    y = layer(x)
    log.phase = "backward"
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(rank)))
    stats = layer.dispatcher.stats
    metric = read_layer_stats(layer, reset=False)

    # The minimum, from this rank's routing map as the one-device router decides it.
    with torch.no_grad():
        probs, routing_map = ref.router(x.detach())
    nle = ref.config.num_experts // world
    per_rank = routing_map.view(routing_map.shape[0], world, nle)
    remote = torch.arange(world) != rank
    floats = (torch.float32,)
    return {
        "D": int(per_rank[:, remote].any(-1).sum()), "A": int(per_rank[:, remote].sum()),
        "mask_bytes": math.ceil(nle / 8) if nle > 1 else 0, "prob_bytes": probs.element_size(),
        "wire": {
            "dispatch": log.total("dispatch", floats), "index": log.total("dispatch", (torch.uint8,)),
            "sizes": log.total("dispatch", (torch.int64,)), "combine": log.total("combine", floats),
            "backward": log.total("backward", floats), "backward other": log.total("backward", (torch.uint8,)),
        },
        "stats": {"dispatch": stats.dispatch_bytes, "index": stats.dispatch_index_bytes,
                  "combine": stats.combine_bytes, "rows": stats.rows_sent},
        "metric": (metric["dispatch_bytes"], metric["combine_bytes"]),
        "reads": {phase: len(counter.calls) for phase, counter in reads.items()},
    }


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world", "overrides", "tokens"),
    [(2, DEDUP, (12, 9)), (4, DEDUP, (12, 9, 5, 10)),
     (2, {**DEDUP, "capacity_factor": 1.0, "pad_to_capacity": True}, (12, 8))],
    ids=["ep2", "ep4", "ep2-drop-and-pad-uneven"],
)
def test_bytes_at_the_collectives_equal_the_deduplicated_minimum(world, overrides, tokens, tmp_path):
    ranks = run_distributed(_wire_rank, world, overrides, tokens, timeout_s=LAUNCH_TIMEOUT_S, tmp_dir=tmp_path)
    hidden_bytes = HIDDEN * 4
    d, a = sum(r["D"] for r in ranks), sum(r["A"] for r in ranks)
    assert d < a, f"premise: top-4 of 16 puts several experts of one rank on some tokens (D={d}, A={a})"
    dispatch = sum(r["wire"]["dispatch"] for r in ranks)
    combine = sum(r["wire"]["combine"] for r in ranks)
    assert dispatch == d * hidden_bytes + a * ranks[0]["prob_bytes"]
    assert combine == d * hidden_bytes
    for rank, r in enumerate(ranks):
        wire, stats = r["wire"], r["stats"]
        assert wire["dispatch"] == r["D"] * hidden_bytes + r["A"] * r["prob_bytes"], rank
        assert wire["index"] == r["D"] * r["mask_bytes"] == stats["index"], rank
        assert (stats["dispatch"], stats["combine"], stats["rows"]) == (wire["dispatch"], wire["combine"], r["D"])
        assert r["metric"] == (stats["dispatch"], stats["combine"]), rank
        assert wire["sizes"] > 0, "the split sizes are exchanged (not counted as payload)"
        assert wire["backward other"] == 0, "the bitmasks have no gradient"
        assert r["reads"] == {"dispatch": 1, "combine": 0}, (rank, r["reads"])
    # Backward moves every forward row back, the other way (so per rank the directions swap).
    assert sum(r["wire"]["backward"] for r in ranks) == dispatch + combine


# ---------------------------------------------------------------------------------------------
# Bitmasks and the local expansion.


def _random_map(rows: int, experts: int, seed: int) -> torch.Tensor:
    local_map = torch.rand(rows, experts, generator=torch.Generator().manual_seed(seed)) < 0.4
    local_map[:, 0] |= ~local_map.any(1)  # every received row has at least one local expert
    return local_map


def _expansion_oracle(local_map: torch.Tensor) -> tuple[list[int], list[int]]:
    """Expert-major (expert, row) pairs; each pair's index in row-major order of the True entries."""
    row_major = [(r, e) for r in range(local_map.shape[0]) for e in range(local_map.shape[1]) if local_map[r, e]]
    expert_major = sorted(row_major, key=lambda pair: (pair[1], pair[0]))
    return [r for r, _ in expert_major], [row_major.index(pair) for pair in expert_major]


@pytest.mark.parametrize("experts", [2, 8, 9, 20])
def test_bitmasks_round_trip_and_the_expansion_matches_a_brute_force_oracle(experts):
    local_map = _random_map(11, experts, seed=experts)
    packed = pack_bits(local_map)
    assert packed.dtype == torch.uint8 and packed.shape == (11, math.ceil(experts / 8))
    assert torch.equal(unpack_bits(packed, experts), local_map)
    row_index, order = expand_rows(local_map, int(local_map.sum()))
    expected_rows, expected_order = _expansion_oracle(local_map)
    assert row_index.tolist() == expected_rows and order.tolist() == expected_order
    empty = torch.zeros(0, experts, dtype=torch.bool)  # a rank that receives no row
    assert [t.numel() for t in expand_rows(empty, 0)] == [0, 0]
    assert unpack_bits(pack_bits(empty), experts).shape == (0, experts)


@pytest.mark.gpu
def test_bitmasks_and_expansion_on_cuda_read_nothing_from_the_device():
    local_map = _random_map(300, 12, seed=1)
    total, cuda_map = int(local_map.sum()), local_map.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        unpacked = unpack_bits(pack_bits(cuda_map), 12)
        row_index, order = expand_rows(unpacked, total)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected_rows, expected_order = _expansion_oracle(local_map)
    assert torch.equal(unpacked.cpu(), local_map)
    assert row_index.tolist() == expected_rows and order.tolist() == expected_order


# ---------------------------------------------------------------------------------------------
# CPU bf16 autocast (the mixed-precision path): dtypes and numerics of the single-device layer.

AUTOCAST_TOL = 2e-2


def _autocast_rank(rank: int, world: int) -> dict:
    ctx = build_parallel_context(ParallelDims(world, ep=world), "cpu")
    ref = build_reference(_config(**DEDUP), seed=5)
    layer = parallelize(copy.deepcopy(ref), ctx, dispatcher="flex")
    counts = (10, 7)
    xs = make_tokens([(c,) for c in counts], seed=6, hidden=HIDDEN)
    dys = make_tokens([(c,) for c in counts], seed=7, hidden=HIDDEN)
    x = xs[rank].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        y_all, gx_all = run_reference(ref, xs, dys)
    y.backward(dys[rank])
    assert y.dtype == y_all.dtype, (y.dtype, y_all.dtype)
    mine = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
    return [(y.detach(), y_all[mine]), (x.grad, gx_all[mine])]


@pytest.mark.distributed
def test_cpu_autocast_keeps_the_single_device_dtypes_and_numerics(tmp_path):
    for pairs in run_distributed(_autocast_rank, 2, timeout_s=LAUNCH_TIMEOUT_S, tmp_dir=tmp_path):
        for got, want in pairs:
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=AUTOCAST_TOL, atol=AUTOCAST_TOL * want.abs().max().item())


# ---------------------------------------------------------------------------------------------
# CUDA-graph scopes: ``moe_router`` is allowed under EP (its staged forward then runs the flex
# dispatch eagerly); ``moe_preprocess`` and ``moe`` are refused as for every EP dispatcher.


def _scopes_rank(rank: int, world: int) -> dict:
    ctx = build_parallel_context(ParallelDims(world, ep=world), "cpu")
    layer = parallelize(build_reference(_config(**DEDUP, shared_expert_ffn_hidden_size=12), seed=14), ctx, "flex")
    check_moe_layer(layer, ["moe_router"])
    with pytest.raises(ValueError, match="the FlexDispatcher dispatcher synchronises with the host"):
        check_moe_layer(layer, ["moe_router", "moe_preprocess"])
    with pytest.raises(ValueError, match="Scope 'moe' on MoELayer"):
        check_moe_layer(layer, ["moe"])
    x = make_tokens([(7,), (11,)], seed=15, hidden=HIDDEN)[rank]
    dy = make_tokens([(7,), (11,)], seed=16, hidden=HIDDEN)[rank]
    outs = []
    for staged in (False, True):
        xb = x.clone().requires_grad_()
        y = experts_forward(layer, router_forward(layer, xb, None)) if staged else layer(xb)
        y.backward(dy)
        outs.append((y.detach(), xb.grad))
    return outs


@pytest.mark.distributed
def test_router_scope_staged_forward_runs_flex_and_the_dispatch_scopes_are_refused(tmp_path):
    for (y, gx), (y_staged, gx_staged) in run_distributed(
        _scopes_rank, 2, timeout_s=LAUNCH_TIMEOUT_S, tmp_dir=tmp_path
    ):
        torch.testing.assert_close(y_staged, y, rtol=0, atol=0)
        torch.testing.assert_close(gx_staged, gx, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Backend selection (one process, fake backend) and the DeepEP backend on a stand-in module.


@pytest.fixture
def fake_ctx():
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield build_parallel_context(ParallelDims(2, ep=2), "cpu")
    dist.destroy_process_group()


def _stub_ctx(device_type: str, etp: int, ep: int = 2) -> types.SimpleNamespace:
    """What the backend choice reads of a context: the device type, the EP and ETP sizes."""
    return types.SimpleNamespace(device_type=device_type, size={"ep": ep, "etp": etp}.__getitem__)


def test_flex_backends_are_chosen_and_refused_with_the_reason(fake_ctx, monkeypatch):
    config = _config()
    assert type(make_dispatcher("flex", config, fake_ctx)) is FlexDispatcher  # auto on CPU: torch
    assert make_dispatcher("flex", config, fake_ctx, flex_backend="torch").backend == "torch"
    unknown = r"Unknown flex_backend 'nccl'; choose one of \['auto', 'torch', 'deepep'\]"
    with pytest.raises(ValueError, match=unknown):
        make_dispatcher("alltoall", config, fake_ctx, flex_backend="nccl")
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # not importable, whatever is installed
    monkeypatch.setattr(deepep, "deep_ep_available", lambda: False)
    with pytest.raises(ImportError, match=r"needs DeepEP.*build github.com/deepseek-ai/DeepEP from source.*flex_backend='torch'"):
        make_dispatcher("flex", config, fake_ctx, flex_backend="deepep")
    layer = build_reference(config, seed=0)
    with pytest.raises(ImportError, match="deepep"):
        apply_expert_parallel(layer, fake_ctx, dispatcher="flex", flex_backend="deepep")
    assert layer.experts.num_experts == 8 and layer.experts.expert_offset == 0  # left unchanged
    monkeypatch.setitem(sys.modules, "deep_ep", _fake_deep_ep())
    monkeypatch.setattr(deepep, "deep_ep_available", lambda: True)
    with pytest.raises(ValueError, match=r"runs on CUDA only .* on 'cpu'"):
        make_dispatcher("flex", config, fake_ctx, flex_backend="deepep")
    assert resolve_flex_backend("auto", config, _stub_ctx(device_type="cuda", etp=1)) == "deepep"
    assert resolve_flex_backend("auto", config, fake_ctx) == "torch"
    for ctx, changed, reason in [
        (_stub_ctx(device_type="cuda", etp=2), config, "expert_tensor_parallel_size=1, got 2"),
        (_stub_ctx(device_type="cuda", etp=1, ep=1), config, "expert_parallel_size > 1"),
        (_stub_ctx(device_type="cuda", etp=1), _config(capacity_factor=1.0, pad_to_capacity=True), "drop-and-pad"),
        (_stub_ctx(device_type="cuda", etp=1), _config(router_padding_alignment=8), "router_padding_alignment=8"),
    ]:
        assert resolve_flex_backend("auto", changed, ctx) == "torch"
        with pytest.raises(ValueError, match=reason):
            resolve_flex_backend("deepep", changed, ctx)


class _StandInBuffer:
    """``deep_ep.Buffer``'s normal-kernel contract on gloo: tokens go once to each rank holding one of
    their experts (by source rank, then token), ``recv_topk_idx`` holds local expert ids (-1 elsewhere),
    combine sums the rows per token."""

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0) -> None:
        self.group, self.num_nvl_bytes, self.num_rdma_bytes = group, num_nvl_bytes, num_rdma_bytes
        self.size = dist.get_world_size(group)

    @staticmethod
    def get_dispatch_config(num_ranks: int):
        return types.SimpleNamespace(get_nvl_buffer_size_hint=lambda hidden_bytes, n: hidden_bytes * n,
                                     get_rdma_buffer_size_hint=lambda hidden_bytes, n: 0)

    get_combine_config = get_dispatch_config

    def _exchange(self, x, send, recv):
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        nle = num_experts // self.size
        owner = torch.where(topk_idx >= 0, topk_idx // nle, -1)
        in_rank = torch.stack([(owner == r).any(1) for r in range(self.size)], 1)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None, **_):
        if handle is not None:
            tokens, send, recv, _ = handle
            return self._exchange(x[tokens], send, recv), None, None, None, None, None
        nle = num_tokens_per_expert.numel() // self.size
        dest, tokens = is_token_in_rank.t().nonzero().unbind(1)
        send = num_tokens_per_rank.tolist()
        recv = self._exchange(torch.tensor(send), [1] * self.size, [1] * self.size).tolist()
        local = topk_idx[tokens] - dest.unsqueeze(1) * nle
        mine = (topk_idx[tokens] >= 0) & (local >= 0) & (local < nle)
        recv_idx = self._exchange(torch.where(mine, local, -1), send, recv)
        recv_weights = self._exchange(torch.where(mine, topk_weights[tokens], 0.0), send, recv)
        counts = [int((recv_idx == e).sum()) for e in range(nle)]
        handle = (tokens, send, recv, x.shape[0])
        return self._exchange(x[tokens], send, recv), recv_idx, recv_weights, counts, handle, None

    def combine(self, x, handle, topk_weights=None, **_):
        tokens, send, recv, num_tokens = handle
        out = x.new_zeros(num_tokens, x.shape[1]).index_add_(0, tokens, self._exchange(x, recv, send))
        if topk_weights is None:
            return out, None, None
        back = self._exchange(topk_weights, recv, send)
        return out, back.new_zeros(num_tokens, back.shape[1]).index_add_(0, tokens, back), None


def _fake_deep_ep() -> types.ModuleType:
    module = types.ModuleType("deep_ep")
    module.__spec__ = importlib.machinery.ModuleSpec("deep_ep", None)
    module.Buffer = _StandInBuffer
    return module


def _stand_in_rank(rank: int, world: int, overrides: dict, oracle: str) -> list:
    sys.modules["deep_ep"] = _fake_deep_ep()
    deepep._SUPPORTED_DEVICE_TYPES = ("cuda", "cpu")
    deepep._TRANSFER_DTYPE = torch.float32  # the stand-in moves fp32: compare with the fp32 oracle exactly
    ctx = build_parallel_context(ParallelDims(world, ep=world), "cpu")
    ref = build_reference(_config(**overrides), seed=8)
    layer = apply_expert_parallel(copy.deepcopy(ref), ctx, dispatcher="flex", flex_backend="deepep")
    assert layer.dispatcher.backend == "deepep"
    counts = (9, 6)
    xs, dys = make_tokens([(c,) for c in counts], 9, HIDDEN), make_tokens([(c,) for c in counts], 10, HIDDEN)
    x = xs[rank].clone().requires_grad_()
    y = layer(x)
    y.backward(dys[rank])
    if oracle == "global":
        y_ref, gx_ref = run_reference(ref, xs, dys)
        first = sum(counts[:rank])
        y_ref, gx_ref = y_ref[first : first + counts[rank]], gx_ref[first : first + counts[rank]]
    else:  # capacity is per rank: the oracle is each rank's own tokens, gradients summed
        y_ref, gx_ref = [run_reference(ref, [xs[r]], [dys[r]]) for r in range(world)][rank]
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    nle = ref.config.num_experts // world
    block = slice(rank * nle, (rank + 1) * nle)
    pairs = [
        (y, y_ref, FP32_OUT_TOL), (x.grad, gx_ref, FP32_GRAD_TOL),
        (router_grad, ref.router.weight.grad, FP32_GRAD_TOL),
        (layer.experts.fc1_weight.grad, ref.experts.fc1_weight.grad[block], FP32_GRAD_TOL),
        (layer.experts.fc2_weight.grad, ref.experts.fc2_weight.grad[block], FP32_GRAD_TOL),
    ]
    with torch.no_grad():
        rows = int(ref.router(xs[rank])[1].view(-1, world, nle)[:, torch.arange(world) != rank].any(-1).sum())
    stats, k = layer.dispatcher.stats, ref.config.top_k  # rows carry k fp32 weights and k int64 ids
    expected = (rows, rows * (HIDDEN * 4 + k * 4), rows * k * 8)
    return [[(a.detach(), b.detach(), tol) for a, b, tol in pairs],
            ((stats.rows_sent, stats.dispatch_bytes, stats.dispatch_index_bytes), expected)]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("overrides", "oracle"),
    [(DEDUP, "global"), ({**DEDUP, "capacity_factor": 1.0}, "per_rank")],
    ids=["dropless", "capacity"],
)
def test_deepep_backend_on_a_stand_in_deep_ep_matches_the_single_device_layer(overrides, oracle, tmp_path):
    for pairs, (stats, expected) in run_distributed(
        _stand_in_rank, 2, overrides, oracle, timeout_s=LAUNCH_TIMEOUT_S, tmp_dir=tmp_path
    ):
        for got, want, tol in pairs:
            torch.testing.assert_close(got, want, rtol=0, atol=tol * max(want.abs().max().item(), 1e-12))
        assert stats == expected


def _deepep_gpu_rank(rank: int, world: int) -> list:
    torch.cuda.set_device(rank)
    ctx = build_parallel_context(ParallelDims(world, ep=world), "cuda")
    ref = build_reference(_config(**DEDUP), seed=11).to("cuda", torch.bfloat16)
    x, dy = (make_tokens([(64,)] * world, seed, HIDDEN)[rank].to("cuda", torch.bfloat16) for seed in (12, 13))
    results = []
    for backend in ("deepep", "torch"):
        layer = apply_expert_parallel(copy.deepcopy(ref), ctx, "flex", flex_backend=backend)
        assert layer.dispatcher.backend == backend
        xb = x.clone().requires_grad_()
        y = layer(xb)
        y.backward(dy)
        results.append([t.float().cpu() for t in (y.detach(), xb.grad, layer.router.weight.grad,
                                                  layer.experts.fc1_weight.grad)])
    return list(zip(*results))


@pytest.mark.gpu
def test_deepep_backend_matches_the_torch_backend_on_two_gpus(tmp_path):
    if not deepep.deep_ep_available():
        pytest.skip("deep_ep (DeepEP) is not installed: the deepep backend cannot run here")
    if torch.cuda.device_count() < 2:
        pytest.skip("DeepEP's intranode kernels need two GPUs (one per EP rank)")
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is initialised in this process already: forked ranks could not use it")
    for pairs in run_distributed(_deepep_gpu_rank, 2, backend="nccl", timeout_s=300, tmp_dir=tmp_path):
        for got, want in pairs:
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=AUTOCAST_TOL, atol=AUTOCAST_TOL * want.abs().max().item())
