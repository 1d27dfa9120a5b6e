"""`build_parallel_context`: groups and meshes at 64-512 fake ranks, and real collectives on 4 gloo ranks."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_moe.parallel import GROUP_NAMES, ParallelDims, build_parallel_context
from lightning_moe.parallel.layout.dims import TP_PP_DP_ORDER
from lightning_moe.parallel.layout.groups import UNBUILT_GROUPS

BUILT = [name for name in GROUP_NAMES if name not in UNBUILT_GROUPS]

# Generous: the three large builds take well under a second; this only catches a quadratic blow-up.
FAKE_BUILD_BUDGET_S = 20.0


@pytest.fixture
def fake_world():
    """``init(rank, world_size)`` joins a fake (communication-free) default group; torn down after."""

    def init(rank: int, world_size: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield init
    # Nothing may leak into later tests (forked gloo ranks inherit this process's state).
    if dist.is_initialized():
        dist.destroy_process_group()


def mesh_lines(mesh, dim: int) -> list[list[int]]:
    """Every line of the mesh tensor along ``dim``: the rank groups that mesh dim stands for."""
    ranks = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.mesh.shape[dim])
    return sorted(ranks.tolist())


def check_context_matches_dims(ctx, dims: ParallelDims, rank: int) -> None:
    assert ctx.global_rank == rank and ctx.dims is dims
    assert ctx.coords == dims.coords(rank)
    for name in GROUP_NAMES:
        members = dims.group_of(name, rank)
        assert ctx.ranks(name) == members, name
        assert ctx.size(name) == len(members), name
        assert ctx.rank_in(name) == members.index(rank), name
        if name in BUILT:
            assert dist.get_process_group_ranks(ctx.group(name)) == members, name
    for mesh, kind in ((ctx.dense_mesh, "dense"), (ctx.expert_mesh, "expert")):
        layout = dims.mesh_layout(kind)
        assert mesh.mesh_dim_names == layout.dim_names
        assert tuple(mesh.shape) == layout.sizes
        coordinate = []
        for dim, name in enumerate(layout.dim_names):
            assert mesh_lines(mesh, dim) == dims.groups(name), (kind, name)
            assert mesh.get_group(name) is ctx.group(name), (kind, name)
            coordinate.append(ctx.rank_in(name))
        assert list(mesh.get_coordinate()) == coordinate, kind


LARGE_LAYOUTS = [
    ParallelDims(64, tp=2, pp=2, etp=1, ep=8),
    ParallelDims(64, tp=2, cp=2, pp=2, etp=1, ep=4, order=TP_PP_DP_ORDER),
    ParallelDims(512, tp=8, cp=2, pp=4, etp=1, ep=16),
    ParallelDims(512),  # pure DP: every axis but dp has size 1 (one local stand-in, no new_group per rank)
]


@pytest.mark.parametrize("dims", LARGE_LAYOUTS, ids=str)
def test_fake_process_group_builds_large_layouts(fake_world, dims):
    start = time.perf_counter()
    for rank in (0, dims.world_size // 2 + 1, dims.world_size - 1):
        fake_world(rank, dims.world_size)
        ctx = build_parallel_context(dims, "cpu")
        check_context_matches_dims(ctx, dims, rank)
    assert time.perf_counter() - start < FAKE_BUILD_BUDGET_S


def test_context_is_immutable_and_checks_names(fake_world):
    fake_world(3, 8)
    ctx = build_parallel_context(ParallelDims(8, tp=2, etp=1, ep=4), "cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.global_rank = 0
    with pytest.raises(TypeError):
        ctx._members["tp"] = (0,)
    # Names of one class with the same members share one process group object (A: tp == tp_cp,
    # ep == etp_ep); see test_dispatch_groups_have_their_own_communicators for the classes.
    assert ctx.group("tp") is ctx.group("tp_cp") and ctx.group("ep") is ctx.group("etp_ep")
    assert "rank 3 of world 8" in str(ctx)
    for lookup in (ctx.group, ctx.ranks, ctx.size, ctx.rank_in):
        with pytest.raises(ValueError, match=r"unknown group name 'mp'; expected one of tp, cp"):
            lookup("mp")
    # The pipeline composites have ranks but no process group (nothing communicates on them).
    assert ctx.ranks("tp_pp") == [2, 3]
    with pytest.raises(ValueError, match=r"no process group is built for 'tp_pp' \(ranks \[2, 3\]\).*new_group"):
        ctx.group("tp_pp")
    # Size-1 names (cp, pp, etp here) share one stand-in of this rank alone.
    assert ctx.group("cp") is ctx.group("pp") is ctx.group("etp")
    assert dist.get_process_group_ranks(ctx.group("cp")) == [3]


REDUCTION_GROUPS = ("dp", "dp_cp", "tp_dp_cp", "edp")  # the gradient buckets' all-reduces


def check_dispatch_apart_from_reduction(ctx) -> None:
    """No token-dispatch group object is a gradient-reduction group object, whatever their members
    (size-1 names share a stand-in without a communicator, so there is no stream to share)."""
    for dispatch in ("tp", "ep", "etp", "etp_ep"):
        for reduction in REDUCTION_GROUPS:
            if ctx.size(dispatch) > 1 or ctx.size(reduction) > 1:
                assert ctx.group(dispatch) is not ctx.group(reduction), (dispatch, reduction)


@pytest.mark.parametrize("dims", [ParallelDims(8, ep=8), ParallelDims(8, ep=4), ParallelDims(8, tp=2, etp=1, ep=4)],
                         ids=str)
def test_dispatch_groups_have_their_own_communicators(fake_world, dims):
    # TP=1, EP=DP: ep, etp_ep, dp, dp_cp and tp_dp_cp have the same members (the world) but the
    # all-to-all must not queue behind the overlapped gradient all-reduces on one communicator.
    for rank in (0, dims.world_size - 1):
        fake_world(rank, dims.world_size)
        ctx = build_parallel_context(dims, "cpu")
        check_context_matches_dims(ctx, dims, rank)
        check_dispatch_apart_from_reduction(ctx)
        if dims.tp == 1 and dims.ep == dims.world_size:
            assert ctx.ranks("ep") == ctx.ranks("dp") == ctx.ranks("tp_dp_cp") == list(range(dims.world_size))
            assert ctx.group("ep") is not ctx.group("dp")
            assert ctx.group("ep") is ctx.group("etp_ep")  # one class, same members: shared
            assert ctx.group("dp") is ctx.group("dp_cp") is ctx.group("tp_dp_cp") is dist.group.WORLD


def test_world_size_mismatch(fake_world):
    fake_world(0, 8)
    with pytest.raises(ValueError, match=r"world_size=8 but the layout expects dims.world_size=4"):
        build_parallel_context(ParallelDims(4), "cpu")


def test_needs_an_initialised_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"call torch.distributed.init_process_group"):
        build_parallel_context(ParallelDims(1), "cpu")


# ---------------------------------------------------------------------------------------------
# Real collectives on 4 gloo ranks

GLOO_LAYOUTS = [
    ParallelDims(4),  # pure DP
    ParallelDims(4, ep=4),  # TP=1, EP=DP: dispatch and reduction groups have the same members
    ParallelDims(4, tp=2, etp=1, ep=4),  # folded: EP spans two TP groups
    ParallelDims(4, etp=2, ep=2),  # expert TP with dense DP=4
    ParallelDims(4, tp=2, cp=2, etp=1, ep=4),  # CP and EP folded onto the same ranks
    ParallelDims(4, pp=2, etp=1, ep=2),  # pipeline shared by both sides
    ParallelDims(4, tp=2, pp=2, etp=1, ep=2, order=TP_PP_DP_ORDER),
]


def _one_rank_collectives(group, rank: int) -> dict[str, bool]:
    """Every collective the package issues, on a one-rank group: each must return its input."""
    x = torch.arange(6.0) + 10 * rank
    out: dict[str, bool] = {}
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG):
        y = x.clone()
        dist.all_reduce(y, op=op, group=group)
        out[f"all_reduce {op}"] = torch.equal(y, x)
    y = x.clone()
    dist.all_reduce(y, group=group, async_op=True).wait()
    out["all_reduce async"] = torch.equal(y, x)
    gathered = [torch.full_like(x, -1.0)]
    dist.all_gather(gathered, x, group=group)
    out["all_gather"] = torch.equal(gathered[0], x)
    for name, collective in (("all_gather_into_tensor", dist.all_gather_into_tensor),
                             ("reduce_scatter_tensor", dist.reduce_scatter_tensor),
                             ("all_to_all_single", dist.all_to_all_single)):
        y = torch.full_like(x, -1.0)
        collective(y, x, group=group)
        out[name] = torch.equal(y, x)
    y = torch.full((4,), -1.0)
    dist.all_to_all_single(y, x[:4], [4], [4], group=group)
    out["all_to_all_single splits"] = torch.equal(y, x[:4])
    y = x.clone()
    dist.broadcast(y, src=rank, group=group)
    out["broadcast"] = torch.equal(y, x)
    objects: list = [None]
    dist.all_gather_object(objects, {"rank": rank}, group=group)
    out["all_gather_object"] = objects == [{"rank": rank}]
    return out


def _collect_group_facts(rank: int, world_size: int, layouts: list[ParallelDims]) -> list[dict]:
    """On each rank, for every layout and group: all_reduce of the global rank, size, rank, members;
    under pure DP, every collective on the size-1 stand-in."""
    facts = []
    for dims in layouts:
        ctx = build_parallel_context(dims, "cpu")
        check_dispatch_apart_from_reduction(ctx)
        sums, sizes, ranks_in = {}, {}, {}
        for name in BUILT:
            value = torch.tensor([float(rank)])
            dist.all_reduce(value, group=ctx.group(name))
            sums[name] = value.item()
            sizes[name] = dist.get_world_size(ctx.group(name))
            ranks_in[name] = (ctx.rank_in(name), dist.get_rank(ctx.group(name)))
        mesh_members = {
            (kind, dim): dist.get_process_group_ranks(mesh.get_group(dim))
            for kind, mesh in (("dense", ctx.dense_mesh), ("expert", ctx.expert_mesh))
            for dim in mesh.mesh_dim_names
        }
        one_rank = _one_rank_collectives(ctx.group("tp"), rank) if dims.tp == dims.ep == 1 else {}
        facts.append({"sums": sums, "sizes": sizes, "ranks_in": ranks_in, "mesh_members": mesh_members,
                      "one_rank": one_rank})
    return facts


@pytest.mark.distributed
def test_gloo_groups_reduce_over_the_predicted_members(tmp_path):
    per_rank = run_distributed(_collect_group_facts, 4, GLOO_LAYOUTS, timeout_s=120, tmp_dir=tmp_path)
    for rank, facts in enumerate(per_rank):
        for dims, fact in zip(GLOO_LAYOUTS, facts):
            where = f"{dims}, rank {rank}"
            assert len(fact["one_rank"]) == (11 if dims.tp == dims.ep == 1 else 0), where
            assert all(fact["one_rank"].values()), (where, fact["one_rank"])
            for name in BUILT:
                members = dims.group_of(name, rank)
                assert fact["sums"][name] == sum(members), (where, name)
                assert fact["sizes"][name] == len(members), (where, name)
                assert fact["ranks_in"][name] == (members.index(rank),) * 2, (where, name)
            for (kind, dim), mesh_members in fact["mesh_members"].items():
                assert mesh_members == dims.group_of(dim, rank), (where, kind, dim)
