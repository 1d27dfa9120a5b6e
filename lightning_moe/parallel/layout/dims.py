"""`ParallelDims`: the folded MoE parallel layout as pure rank arithmetic (no process needed).

MoE Parallel Folding (arXiv 2504.14960, Megatron Core ``parallel_state.py``) lays the same world
of ranks out twice:

* the dense side (attention, norms, router, shared expert) on the axes ``tp, cp, dp, pp``;
* the expert side (routed experts) on the axes ``etp, ep, edp, pp``.

Both layouts come from one order string, leftmost axis = fastest varying (smallest stride), exactly
as Megatron's ``RankGenerator``: the dense generator sees sizes ``tp, cp, ep=1, dp, pp`` and the
expert generator ``tp:=etp, cp=1, ep, dp:=edp, pp``. Only the pipeline groups must coincide; the
other groups of the two sides overlap freely, which is what lets e.g. EP exceed DP when TP > 1.

Group membership equals Megatron's ``get_ranks`` (groups enumerated by the coordinates outside the
group, members by the coordinates inside it, first axis of the order fastest). With this mixed-radix
layout Megatron's enumeration is already ascending, so the sorted lists returned here are the same
lists in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import NamedTuple

__all__ = [
    "AXES",
    "DEFAULT_ORDER",
    "GROUP_NAMES",
    "MESH_DIM_NAMES",
    "TP_PP_DP_ORDER",
    "MeshLayout",
    "ParallelDims",
    "RankCoords",
]

AXES = ("tp", "cp", "ep", "dp", "pp")
"""Axis names an order string is made of (the expert side reads ``tp`` as ETP and ``dp`` as EDP)."""

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
"""Megatron's default order: TP fastest (intra-node), PP slowest."""

TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"
"""Megatron's ``--use-tp-pp-dp-mapping`` order; needs ``pp == 1`` or ``edp == dp``."""

_DENSE = "dense"
_EXPERT = "expert"

# Public group name -> (generator it comes from, the generator's axes the group spans).
_GROUP_SPECS = MappingProxyType(
    {
        "tp": (_DENSE, ("tp",)),
        "cp": (_DENSE, ("cp",)),
        "dp": (_DENSE, ("dp",)),
        "dp_cp": (_DENSE, ("dp", "cp")),
        "tp_cp": (_DENSE, ("tp", "cp")),
        "tp_dp_cp": (_DENSE, ("tp", "dp", "cp")),
        "pp": (_DENSE, ("pp",)),
        "tp_pp": (_DENSE, ("tp", "pp")),
        "ep": (_EXPERT, ("ep",)),
        "etp": (_EXPERT, ("tp",)),
        "edp": (_EXPERT, ("dp",)),
        "etp_ep": (_EXPERT, ("tp", "ep")),
        "etp_ep_pp": (_EXPERT, ("tp", "ep", "pp")),
    }
)

GROUP_NAMES = tuple(_GROUP_SPECS)
"""Every group name `ParallelDims.groups` and `ParallelContext.group` accept."""

MESH_DIM_NAMES = MappingProxyType({_DENSE: ("pp", "dp", "cp", "tp"), _EXPERT: ("pp", "edp", "ep", "etp")})
"""Dimension names of the dense and expert device meshes, slowest first (PyTorch's convention)."""


class RankCoords(NamedTuple):
    """One rank's coordinate on every axis of both layouts (``pp`` is shared by both)."""

    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    etp: int
    edp: int


class MeshLayout(NamedTuple):
    """A device mesh as strides over global ranks: ``mesh[i0, i1, ...] = sum(i_k * strides[k])``."""

    dim_names: tuple[str, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...]


@dataclass(frozen=True)
class _RankGrid:
    """One Megatron ``RankGenerator``: axis sizes listed in order, the first axis fastest varying."""

    order: tuple[str, ...]
    sizes: tuple[int, ...]

    @cached_property
    def strides(self) -> tuple[int, ...]:
        """Stride of each axis: the product of the sizes of the axes before it."""
        return tuple(math.prod(self.sizes[:i]) for i in range(len(self.sizes)))

    def size(self, axis: str) -> int:
        """Number of coordinates on ``axis``."""
        return self.sizes[self.order.index(axis)]

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours on ``axis``."""
        return self.strides[self.order.index(axis)]

    def coord(self, rank: int, axis: str) -> int:
        """Coordinate of ``rank`` on ``axis``."""
        return rank // self.stride(axis) % self.size(axis)

    def offsets(self, axes: tuple[str, ...]) -> tuple[int, ...]:
        """Rank offsets spanned by ``axes`` (all their coordinate combinations), ascending.

        Built first axis fastest like Megatron's listing, which is then already ascending; the sort
        only makes that guarantee explicit.
        """
        offsets = [0]
        for axis, size, stride in zip(self.order, self.sizes, self.strides):
            if axis in axes:
                offsets = [coord * stride + offset for coord in range(size) for offset in offsets]
        return tuple(sorted(offsets))

    def groups(self, axes: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """All groups spanning ``axes``: one per coordinate of the other axes, ascending."""
        members = self.offsets(axes)
        bases = self.offsets(tuple(axis for axis in self.order if axis not in axes))
        return tuple(tuple(base + member for member in members) for base in bases)

    def group_of(self, axes: tuple[str, ...], rank: int) -> tuple[int, ...]:
        """The group spanning ``axes`` that contains ``rank``."""
        base = rank - sum(self.coord(rank, axis) * self.stride(axis) for axis in axes)
        return tuple(base + member for member in self.offsets(axes))


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the folded MoE layout, their validation and every rank group they imply.

    Args:
        world_size: number of ranks.
        tp: dense tensor-parallel size (attention, shared expert, router sequence parallel).
        cp: context-parallel size (dense side only).
        pp: pipeline-parallel size (shared by both sides).
        ep: expert-parallel size (expert side only).
        etp: expert tensor-parallel size; defaults to ``tp`` as in Megatron (so "TP=2, EP=4"
            alone needs 8 ranks; pass ``etp=1`` to fold EP over the TP ranks).
        order: axis order, leftmost fastest: ``"tp-cp-ep-dp-pp"`` (default) or
            ``"tp-cp-ep-pp-dp"`` (Megatron ``--use-tp-pp-dp-mapping``). Any permutation of the
            five axes is accepted as long as both sides get the same pipeline groups.

    Derived sizes: ``dp = world_size / (tp*cp*pp)`` and ``edp = world_size / (etp*ep*pp)``.
    Invalid layouts raise `ValueError` naming the sizes involved and values that would work.
    """

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    order: str = DEFAULT_ORDER

    def __post_init__(self) -> None:
        # Frozen dataclass: normalised values are written with object.__setattr__, once, here.
        etp_given = self.etp is not None
        for name in ("world_size", "tp", "cp", "pp", "ep", "etp"):
            value = getattr(self, name)
            if value is not None:
                _check_positive_int(name, value)
        if not etp_given:
            object.__setattr__(self, "etp", self.tp)
        object.__setattr__(self, "order", "-".join(_parse_order(self.order)))
        self._check_divisible("dense", "tp*cp*pp", {"tp": self.tp, "cp": self.cp, "pp": self.pp}, "tp")
        # The etp=tp default is the usual surprise behind an expert-side error ("TP=2, EP=4" on 4 ranks).
        etp_note = (
            ""
            if etp_given or self.tp == 1
            else f" (etp defaults to tp={self.tp}; pass etp=1 to fold EP over the TP ranks)"
        )
        self._check_divisible(
            "expert", "etp*ep*pp", {"etp": self.etp, "ep": self.ep, "pp": self.pp}, "ep", note=etp_note
        )
        self._check_pipeline_groups_match()

    # ------------------------------------------------------------------ derived sizes

    @property
    def dp(self) -> int:
        """Dense data-parallel size ``world_size / (tp*cp*pp)``."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size ``world_size / (etp*ep*pp)``."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @cached_property
    def _grids(self) -> dict[str, _RankGrid]:
        # Cached in the instance __dict__ (allowed on a frozen dataclass); a plain dict so the
        # object stays picklable and deep-copyable. Never handed out, so never mutated.
        order = tuple(self.order.split("-"))
        dense = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        expert = {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp}
        return {
            _DENSE: _RankGrid(order, tuple(dense[axis] for axis in order)),
            _EXPERT: _RankGrid(order, tuple(expert[axis] for axis in order)),
        }

    # ------------------------------------------------------------------ groups and coordinates

    def groups(self, name: str) -> list[list[int]]:
        """Every rank group of kind ``name`` (one of `GROUP_NAMES`), each sorted, ordered by first rank."""
        side, axes = _group_spec(name)
        return [list(group) for group in self._grids[side].groups(axes)]

    def group_of(self, name: str, rank: int) -> list[int]:
        """The sorted members of the ``name`` group that contains global ``rank``."""
        side, axes = _group_spec(name)
        self._check_rank(rank)
        return list(self._grids[side].group_of(axes, rank))

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of global ``rank`` on every axis; each equals its index in the one-axis group."""
        self._check_rank(rank)
        dense, expert = self._grids[_DENSE], self._grids[_EXPERT]
        return RankCoords(
            tp=dense.coord(rank, "tp"),
            cp=dense.coord(rank, "cp"),
            dp=dense.coord(rank, "dp"),
            pp=dense.coord(rank, "pp"),
            ep=expert.coord(rank, "ep"),
            etp=expert.coord(rank, "tp"),
            edp=expert.coord(rank, "dp"),
        )

    def mesh_layout(self, kind: str) -> MeshLayout:
        """Shape and rank strides of the ``"dense"`` (pp, dp, cp, tp) or ``"expert"`` (pp, edp, ep, etp) mesh."""
        if kind not in MESH_DIM_NAMES:
            raise ValueError(f"mesh kind must be 'dense' or 'expert', got {kind!r}")
        grid = self._grids[kind]
        # Mesh dim names map onto generator axes: the expert side calls its tp/dp axes etp/edp.
        axes = [{"etp": "tp", "edp": "dp"}.get(dim, dim) for dim in MESH_DIM_NAMES[kind]]
        return MeshLayout(
            dim_names=MESH_DIM_NAMES[kind],
            sizes=tuple(grid.size(axis) for axis in axes),
            strides=tuple(grid.stride(axis) for axis in axes),
        )

    # ------------------------------------------------------------------ experts

    def validate_num_experts(self, num_experts: int) -> None:
        """Raise `ValueError` unless ``num_experts`` splits evenly over the ``ep`` ranks."""
        _check_positive_int("num_experts", num_experts)
        if num_experts % self.ep != 0:
            world_ep = self.world_size // (self.etp * self.pp)
            fitting = [ep for ep in _divisors(world_ep) if num_experts % ep == 0]
            raise ValueError(
                f"num_experts={num_experts} is not divisible by ep={self.ep}; every EP rank must hold "
                f"the same number of experts. With world_size={self.world_size}, etp={self.etp}, "
                f"pp={self.pp} these ep values work: {fitting}; or use a multiple of {self.ep} experts."
            )

    def num_local_experts(self, num_experts: int) -> int:
        """Experts held by each EP rank: ``num_experts / ep``."""
        self.validate_num_experts(num_experts)
        return num_experts // self.ep

    def local_experts(self, rank: int, num_experts: int) -> range:
        """Global indices of the experts held by global ``rank``: ``[ep_rank*nle, (ep_rank+1)*nle)``."""
        per_rank = self.num_local_experts(num_experts)
        ep_rank = self.coords(rank).ep
        return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)

    # ------------------------------------------------------------------ text

    def describe(self) -> str:
        """One-line summary, e.g. ``world 8: dense TP2 CP1 DP4 PP1 | expert ETP1 EP4 EDP2 PP1``."""
        text = (
            f"world {self.world_size}: dense TP{self.tp} CP{self.cp} DP{self.dp} PP{self.pp} "
            f"| expert ETP{self.etp} EP{self.ep} EDP{self.edp} PP{self.pp}"
        )
        return text if self.order == DEFAULT_ORDER else f"{text} (order {self.order})"

    def __str__(self) -> str:
        return self.describe()

    # ------------------------------------------------------------------ validation helpers

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")

    def _check_divisible(
        self, side: str, product_text: str, sizes: dict[str, int], free_axis: str, note: str = ""
    ) -> None:
        product = math.prod(sizes.values())
        if self.world_size % product == 0:
            return
        others = math.prod(size for axis, size in sizes.items() if axis != free_axis)
        given = ", ".join(f"{axis}={size}" for axis, size in sizes.items())
        if self.world_size % others == 0:
            fixed = ", ".join(f"{axis}={size}" for axis, size in sizes.items() if axis != free_axis)
            hint = f"with {fixed}, {free_axis} must divide {self.world_size // others}: one of {_divisors(self.world_size // others)}"
        else:
            hint = f"{product_text} must be one of {_divisors(self.world_size)}"
        raise ValueError(
            f"world_size={self.world_size} is not divisible by {product_text} = {product} ({given}) on the "
            f"{side} side{note}; {hint}."
        )

    def _check_pipeline_groups_match(self) -> None:
        # Pipeline groups are {base + k*stride}: equal strides give equal groups, and for pp > 1
        # different strides give different ones. Dense and expert stages must be the same ranks.
        dense, expert = self._grids[_DENSE], self._grids[_EXPERT]
        if self.pp == 1 or dense.stride("pp") == expert.stride("pp"):
            return
        order = self.order.split("-")
        before_pp = "*".join(order[: order.index("pp")])
        raise ValueError(
            f"dense and expert pipeline groups differ with order {self.order!r} and pp={self.pp}: the pp "
            f"stride (product of the sizes before pp, {before_pp!r}) is {dense.stride('pp')} on the dense "
            f"side (dp={self.dp}) but {expert.stride('pp')} on the expert side (edp={self.edp}). Use order "
            f"{DEFAULT_ORDER!r} (pp last), or choose etp*ep = tp*cp = {self.tp * self.cp} so that edp == dp."
        )


def _group_spec(name: str) -> tuple[str, tuple[str, ...]]:
    try:
        return _GROUP_SPECS[name]
    except KeyError:
        raise ValueError(f"unknown group name {name!r}; expected one of {', '.join(GROUP_NAMES)}") from None


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _parse_order(order: object) -> tuple[str, ...]:
    """Split and check an order string: each of `AXES` exactly once, e.g. ``"tp-cp-ep-dp-pp"``."""
    usage = (
        f"it must name each of {', '.join(AXES)} exactly once, joined by '-', leftmost fastest, e.g. "
        f"{DEFAULT_ORDER!r} (default) or {TP_PP_DP_ORDER!r}"
    )
    if not isinstance(order, str):
        raise ValueError(f"order must be a string, got {type(order).__name__} {order!r}; {usage}")
    axes = tuple(order.strip().lower().split("-"))
    problems = []
    unknown = [axis for axis in axes if axis not in AXES]
    if unknown:
        problems.append(f"unknown axis {', '.join(map(repr, unknown))}")
    duplicated = sorted({axis for axis in axes if axes.count(axis) > 1})
    if duplicated:
        problems.append(f"duplicate axis {', '.join(map(repr, duplicated))}")
    missing = [axis for axis in AXES if axis not in axes]
    if missing:
        problems.append(f"missing axis {', '.join(map(repr, missing))}")
    if len(axes) != len(AXES):
        problems.append(f"{len(axes)} axes instead of {len(AXES)}")
    if problems:
        raise ValueError(f"invalid order {order!r} ({'; '.join(problems)}): {usage}")
    return axes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
