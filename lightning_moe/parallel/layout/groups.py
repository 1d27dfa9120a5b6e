"""`ParallelContext`: the process groups and device meshes of one `ParallelDims` layout, on this rank.

`build_parallel_context` turns the pure rank arithmetic of `ParallelDims` into
``torch.distributed`` process groups on the current default process group (any backend: gloo on
CPU, nccl on GPU, the ``fake`` backend in layout tests) and wraps them, read-only, with the two
``DeviceMesh`` views the rest of the code uses:

* ``dense_mesh`` with dims ``(pp, dp, cp, tp)``: attention, norms, router, shared expert;
* ``expert_mesh`` with dims ``(pp, edp, ep, etp)``: routed experts.

Communicators come in two classes that never share a process group object, even where their
member lists coincide (at TP=1 with EP=DP, ``ep`` and ``dp`` both span the world):

* `CRITICAL_PATH_GROUPS` (``tp cp tp_cp ep etp etp_ep``): collectives inside the forward and
  backward of every layer, which the next computation waits for: the token all-to-all and
  all-gather of the dispatchers, tensor/sequence-parallel gathers and scatters, the router's
  per-step loss sums (re-run in backward under recompute), context-parallel attention;
* all other names, among them the gradient reductions ``dp dp_cp tp_dp_cp edp``: the bucket
  all-reduces that `GradSync` keeps in flight during backward. On NCCL a process group has one
  stream, so a dispatch all-to-all on the reduction communicator would queue behind them.

Within a class, names with the same members share one object (``ep`` and ``etp_ep`` at ETP=1 are
one communicator; ``dp`` and ``dp_cp`` at CP=1 another): their collectives are issued one after the
other by the same code anyway, and every distinct communicator costs a connection (NCCL: its own
buffers on the device, and with ``device_id`` bound an eager ``ncclCommSplit`` that every rank of
the world joins). So a context creates only what the layout uses:

* no one-rank groups: a size-1 axis needs no communicator. Every size-1 name of this rank gets
  one shared stand-in, a one-rank group on torch's communication-free ``fake`` backend that this
  rank creates alone (``use_local_synchronization``; no other rank joins, nothing connects). Its
  collectives are the identity, which is what a collective over one rank computes, so callers and
  the size-1 mesh dims use it like any group (tests/parallel/test_context.py checks each
  collective the package uses);
* a reduction-class name that spans the world (``tp_dp_cp`` whenever PP=1) is the default
  process group, as ``DeviceMesh`` does for a world-sized dim (its timeout is the default
  group's; the Lightning strategy sets both to its ``timeout``);
* `UNBUILT_GROUPS` (``tp_pp etp_ep_pp``, the pipeline composites) get no process group: no code
  communicates on them. Their ranks are known (``ctx.ranks``); ``ctx.group`` says how to build one.

Cost: ``torch.distributed.new_group`` is collective over the whole world (every rank must call it
for every group, in the same order, members or not), so building a context makes one call per
distinct member list of two ranks or more in each class, over the built names: at world 64, TP=8,
EP=8 that is 16 calls (8 TP blocks, 8 DP groups), where one group per list and name made 153.
``use_local_synchronization=True`` would let non-members skip those calls, but it names groups by
a hash of their members and of the number of groups this process already has, which then differs
between members and hangs the rendezvous. The meshes are built with ``DeviceMesh.from_group`` on
these same groups, so they create no extra process groups.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_moe.compat import register_fake_backend
from lightning_moe.parallel.layout.dims import GROUP_NAMES, MESH_DIM_NAMES, ParallelDims, RankCoords

__all__ = ["CRITICAL_PATH_GROUPS", "UNBUILT_GROUPS", "ParallelContext", "build_parallel_context"]

CRITICAL_PATH_GROUPS = frozenset({"tp", "cp", "tp_cp", "ep", "etp", "etp_ep"})
"""Group names whose communicators are never shared with the gradient reductions' (module docstring)."""

UNBUILT_GROUPS = frozenset({"tp_pp", "etp_ep_pp"})
"""Group names no code communicates on: a context knows their ranks but creates no process group."""


@dataclass(frozen=True, eq=False)
class ParallelContext:
    """This rank's view of a parallel layout: its process group of each name, and the device meshes.

    Built by `build_parallel_context`; immutable. Group names are `GROUP_NAMES`
    (``tp cp dp dp_cp tp_cp tp_dp_cp pp tp_pp ep etp edp etp_ep etp_ep_pp``); `UNBUILT_GROUPS`
    have ranks but no process group. Names whose member lists coincide share one process group
    object only if both are in `CRITICAL_PATH_GROUPS` or both are not: token dispatch never shares
    a communicator with the gradient reductions. Size-1 names share one communication-free
    stand-in (module docstring).
    """

    dims: ParallelDims
    """The layout this context realises."""

    global_rank: int
    """This process's rank in the default process group."""

    device_type: str
    """Device type of the meshes (``"cpu"``, ``"cuda"``, ...)."""

    dense_mesh: DeviceMesh
    """Mesh of the dense side, dims ``("pp", "dp", "cp", "tp")``."""

    expert_mesh: DeviceMesh
    """Mesh of the expert side, dims ``("pp", "edp", "ep", "etp")``."""

    # Read-only views (MappingProxyType): group name -> this rank's process group / its members.
    _groups: Mapping[str, dist.ProcessGroup] = field(repr=False)
    _members: Mapping[str, tuple[int, ...]] = field(repr=False)

    @property
    def coords(self) -> RankCoords:
        """This rank's coordinate on every axis (same as ``dims.coords(global_rank)``)."""
        return self.dims.coords(self.global_rank)

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of kind ``name`` that contains this rank.

        For a size-1 name: a one-rank group without a communicator (its collectives are the
        identity). Raises `ValueError` for `UNBUILT_GROUPS`."""
        if _check_name(name) in UNBUILT_GROUPS:
            raise ValueError(
                f"no process group is built for {name!r} (ranks {list(self._members[name])}): nothing in "
                f"lightning_moe communicates on it. To use one, create it on every rank, in the same "
                f"order: for ranks in ctx.dims.groups({name!r}): group = torch.distributed.new_group(ranks), "
                f"keeping the one that contains this rank"
            )
        return self._groups[name]

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's ``name`` group, ascending (group rank i is ``ranks[i]``)."""
        return list(self._members[_check_name(name)])

    def size(self, name: str) -> int:
        """Number of ranks in this rank's ``name`` group."""
        return len(self._members[_check_name(name)])

    def rank_in(self, name: str) -> int:
        """This rank's index in its ``name`` group (its rank within that process group)."""
        return self._members[_check_name(name)].index(self.global_rank)

    def __str__(self) -> str:
        return f"ParallelContext(rank {self.global_rank} of {self.dims.describe()})"


def build_parallel_context(
    dims: ParallelDims, device_type: str, timeout: timedelta | None = None
) -> ParallelContext:
    """Create every process group and both device meshes of ``dims`` on the default process group.

    Must be called by every rank of the default group, with equal ``dims`` (it is a sequence of
    collective ``new_group`` calls). ``timeout`` bounds every collective on these groups (None:
    torch's default, 10 minutes on NCCL and 30 on gloo; pass the job's, as the Lightning strategy
    does, so that a rank that stops answering fails the job in time). Raises `RuntimeError` if
    ``torch.distributed`` is not initialised and `ValueError` if its world size differs from
    ``dims.world_size``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "build_parallel_context needs an initialised default process group; call "
            "torch.distributed.init_process_group(...) first (or let the Lightning strategy do it)"
        )
    world_size = dist.get_world_size()
    if world_size != dims.world_size:
        raise ValueError(
            f"the default process group has world_size={world_size} but the layout expects "
            f"dims.world_size={dims.world_size} ({dims.describe()}); build ParallelDims with "
            f"world_size={world_size}"
        )
    rank = dist.get_rank()
    groups: dict[str, dist.ProcessGroup] = {}
    members = {name: tuple(dims.group_of(name, rank)) for name in GROUP_NAMES}
    # One process group per distinct (class, member list) of two ranks or more. Every rank walks the
    # same names and lists in the same order, which is what new_group requires (its default names
    # are a global counter).
    created: dict[tuple[bool, tuple[int, ...]], dist.ProcessGroup | None] = {}
    built = [name for name in GROUP_NAMES if name not in UNBUILT_GROUPS]
    for name in built:
        critical = name in CRITICAL_PATH_GROUPS
        for group_ranks in dims.groups(name):
            key = (critical, tuple(group_ranks))
            if len(group_ranks) == 1 or key in created:
                continue
            if not critical and len(group_ranks) == world_size:
                created[key] = dist.group.WORLD
            else:
                created[key] = dist.new_group(list(key[1]), timeout=timeout, group_desc=f"lightning_moe_{name}")
    one_rank = [name for name in built if len(members[name]) == 1]
    # After every world-wide call: this rank alone creates it, so it must not sit between them.
    stand_in = _one_rank_group(timeout) if one_rank else None
    for name in built:
        critical = name in CRITICAL_PATH_GROUPS
        groups[name] = stand_in if name in one_rank else created[(critical, members[name])]

    dense_mesh, expert_mesh = (
        _mesh_from_groups(dims, kind, groups, device_type) for kind in ("dense", "expert")
    )
    return ParallelContext(
        dims=dims,
        global_rank=rank,
        device_type=device_type,
        dense_mesh=dense_mesh,
        expert_mesh=expert_mesh,
        _groups=MappingProxyType(groups),
        _members=MappingProxyType(members),
    )


def _one_rank_group(timeout: timedelta | None) -> dist.ProcessGroup:
    """This rank alone as a group on the ``fake`` backend: no communicator, no other rank joins.

    A collective over one rank is the identity, and the fake backend computes exactly that for a
    group of size 1 (it copies inputs to outputs and reduces nothing). torch registers the backend
    in the module :func:`~lightning_moe.compat.register_fake_backend` imports (shipped with torch,
    used by ``DeviceMesh`` for disabled dims)."""
    register_fake_backend()

    return dist.new_group(
        [dist.get_rank()], timeout=timeout, backend="fake", use_local_synchronization=True,
        group_desc="lightning_moe_one_rank",
    )


def _mesh_from_groups(
    dims: ParallelDims, kind: str, groups: dict[str, dist.ProcessGroup], device_type: str
) -> DeviceMesh:
    """A DeviceMesh over the existing groups: ``mesh[i, j, ...] = sum(index * rank stride)``."""
    layout = dims.mesh_layout(kind)
    # as_strided over arange(world) places rank sum(i_k * stride_k) at index (i_0, i_1, ...): the
    # world reshaped by the order string and permuted to the mesh's dim order in one step.
    mesh = torch.as_strided(torch.arange(dims.world_size, dtype=torch.int), layout.sizes, layout.strides)
    return DeviceMesh.from_group(
        [groups[dim] for dim in MESH_DIM_NAMES[kind]],
        device_type,
        mesh=mesh.contiguous(),
        mesh_dim_names=layout.dim_names,
    )


def _check_name(name: str) -> str:
    if name not in GROUP_NAMES:
        raise ValueError(f"unknown group name {name!r}; expected one of {', '.join(GROUP_NAMES)}")
    return name
