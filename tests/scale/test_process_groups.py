"""The process groups a rank creates at scale: membership as `ParallelDims` predicts, nothing else.

``build_parallel_context`` is run on one fake rank with ``torch.distributed.new_group`` wrapped to
record every call (its member list, backend, whether other ranks join it, and the group it
returned). What the CPU cannot show: the cost of each communicator on NCCL (with ``device_id``
bound, every world-wide ``new_group`` is an eager ``ncclCommSplit`` that all ranks join), which
only a multi-GPU run measures; `benchmarks/gpu_check.sh` runs on one GPU, where every axis has
size 1 and no communicator but the default one may be created.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch.distributed as dist

from lightning_moe.parallel import ParallelDims, build_parallel_context
from lightning_moe.parallel.layout.dims import GROUP_NAMES
from lightning_moe.parallel.layout.groups import CRITICAL_PATH_GROUPS
from lightning_moe.planning.fake_world import fake_rank

# Mixtral 8x7B and Qwen3-30B-A3B layouts of test_param_bytes.py.
LAYOUTS = [ParallelDims(world_size=64, tp=8, ep=8, etp=1), ParallelDims(world_size=128, tp=4, ep=32, etp=1)]

# Names no code communicates on (the pipeline composites): ranks only, no process group.
NOT_BUILT = ("tp_pp", "etp_ep_pp")


@dataclass(frozen=True)
class Call:
    """One recorded ``new_group`` call."""

    ranks: tuple[int, ...]
    backend: str | None
    local: bool  # use_local_synchronization: only the members call it
    group: object


def _record_new_group(monkeypatch) -> list[Call]:
    calls: list[Call] = []
    real = dist.new_group

    def new_group(ranks=None, *args, **kwargs):
        group = real(ranks, *args, **kwargs)
        calls.append(Call(tuple(ranks), kwargs.get("backend"), bool(kwargs.get("use_local_synchronization")), group))
        return group

    monkeypatch.setattr(dist, "new_group", new_group)
    return calls


def _world_calls(calls: list[Call]) -> list[Call]:
    """The calls every rank of the world joins (on NCCL with a bound device: one split each)."""
    return [call for call in calls if not call.local]


@pytest.mark.parametrize("dims", LAYOUTS, ids=[f"w{d.world_size}-tp{d.tp}-ep{d.ep}" for d in LAYOUTS])
def test_each_rank_gets_the_groups_the_layout_predicts(monkeypatch, dims):
    """On ranks 0 and 37, every built name's group has the members ``dims.group_of(name, rank)`` and
    is one this rank created (a world-spanning reduction group: the default group), and every
    created member list is a group of some name of the layout."""
    predicted_lists = {tuple(g) for name in GROUP_NAMES for g in dims.groups(name)}
    for rank in (0, 37):
        calls = _record_new_group(monkeypatch)
        with fake_rank(rank, dims.world_size):
            ctx = build_parallel_context(dims, "cpu")
            created = {id(call.group): call.ranks for call in calls}
            for name in GROUP_NAMES:
                expected = dims.group_of(name, rank)
                assert ctx.ranks(name) == expected, name
                if name in NOT_BUILT:
                    continue
                group = ctx.group(name)
                assert dist.get_process_group_ranks(group) == expected, name
                if len(expected) == dims.world_size and name not in CRITICAL_PATH_GROUPS:
                    assert group is dist.group.WORLD, name
                else:
                    assert created[id(group)] == tuple(expected), name
        assert {call.ranks for call in calls} <= predicted_lists
        monkeypatch.undo()


def test_no_one_rank_groups(monkeypatch):
    """Mixtral at world 64, TP=8, EP=8, ETP=1 (CP, PP and ETP have size 1): no one-rank group has a
    communicator or is joined by other ranks. The size-1 axes share one stand-in that this rank
    creates alone (``use_local_synchronization``) on the communication-free ``fake`` backend."""
    dims = LAYOUTS[0]
    calls = _record_new_group(monkeypatch)
    with fake_rank(0, dims.world_size):
        build_parallel_context(dims, "cpu")
    singletons = [call for call in calls if len(call.ranks) == 1]
    real = [call for call in singletons if call.backend != "fake" or not call.local]
    assert not real, f"{len(real)} of {len(calls)} new_group calls make a one-rank group with a communicator"
    assert [call.ranks for call in singletons] == [(0,)]


@pytest.mark.parametrize("dims", LAYOUTS, ids=[f"w{d.world_size}-tp{d.tp}-ep{d.ep}" for d in LAYOUTS])
def test_world_wide_group_count_follows_from_the_layout(monkeypatch, dims):
    """The ``new_group`` calls every rank joins: one per distinct member list of more than one rank
    and fewer than the world, per class (dispatch / reduction), over the names some code
    communicates on. By hand, with ETP=1 and CP=PP=1: dispatch are the W/tp TP blocks (tp, tp_cp)
    and the W/ep EP blocks (ep, etp_ep), reduction the W/dp DP groups (dp, dp_cp) and the W/edp
    EDP groups (edp); at EP=TP the EP blocks are the TP blocks and the EDP groups the DP groups.
    tp_dp_cp spans the world and is the default group."""
    used = [name for name in GROUP_NAMES if name not in NOT_BUILT]
    expected = sum(
        len({tuple(g) for name in used if (name in CRITICAL_PATH_GROUPS) == critical
             for g in dims.groups(name) if 1 < len(g) < dims.world_size})
        for critical in (True, False)
    )
    w = dims.world_size
    by_hand = w // dims.tp + w // dims.dp if dims.ep == dims.tp else w // dims.tp + w // dims.ep + w // dims.dp + w // dims.edp
    assert expected == by_hand
    calls = _record_new_group(monkeypatch)
    with fake_rank(0, dims.world_size):
        build_parallel_context(dims, "cpu")
    assert len(_world_calls(calls)) == expected
    assert all(1 < len(call.ranks) < dims.world_size for call in _world_calls(calls))
