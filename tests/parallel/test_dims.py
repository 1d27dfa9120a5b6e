"""`ParallelDims`: Megatron's worked examples, layout invariants over many worlds, and every error."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import pickle
import random

import pytest

from lightning_moe.parallel import GROUP_NAMES, ParallelDims
from lightning_moe.parallel.layout.dims import AXES, DEFAULT_ORDER, TP_PP_DP_ORDER


def singletons(world: int) -> list[list[int]]:
    return [[rank] for rank in range(world)]


def consecutive(world: int, size: int) -> list[list[int]]:
    """``[0..size-1], [size..2*size-1], ...``: how the reference writes "[0,1] [2,3] …"."""
    return [list(range(start, start + size)) for start in range(0, world, size)]


# Examples A-H of docs/numerics.md §14 (output of Megatron's RankGenerator), order tp-cp-ep-dp-pp
# unless stated. Every group Megatron builds for an example is spelled out here.
WORKED_EXAMPLES = {
    "A": (
        dict(world_size=8, tp=2, etp=1, ep=4),
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "cp": singletons(8),
            "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "tp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "tp_dp_cp": [[0, 1, 2, 3, 4, 5, 6, 7]],
            "pp": singletons(8),
            "etp": singletons(8),
            "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "etp_ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        },
    ),
    "B": (
        dict(world_size=8, tp=2, etp=1, ep=8),
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "ep": [list(range(8))],
            "etp_ep": [list(range(8))],
            "etp": singletons(8),
            "edp": singletons(8),
        },
    ),
    "C": (
        dict(world_size=16, tp=2, etp=1, ep=8),
        {
            "tp": consecutive(16, 2),
            "dp": [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]],
            "tp_dp_cp": [list(range(16))],
            "ep": [list(range(8)), list(range(8, 16))],
            "etp_ep": [list(range(8)), list(range(8, 16))],
            "edp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
            "etp": singletons(16),
        },
    ),
    "D": (
        dict(world_size=16, tp=2, pp=2, etp=1, ep=4),
        {
            "tp": consecutive(16, 2),
            "dp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
            "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
            "tp_pp": [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]],
            "tp_dp_cp": [list(range(8)), list(range(8, 16))],
            "ep": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
            "edp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
            "etp_ep_pp": [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]],
        },
    ),
    "E": (
        dict(world_size=8, tp=1, cp=4, etp=1, ep=8),
        {
            "cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "dp_cp": [list(range(8))],
            "tp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "ep": [list(range(8))],
            "edp": singletons(8),
        },
    ),
    "F": (
        dict(world_size=8, tp=2, cp=2, etp=1, ep=4),
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "tp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        },
    ),
    "G": (
        dict(world_size=16, tp=2, cp=2, pp=2, etp=2, ep=4),
        {
            "tp": consecutive(16, 2),
            "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
            "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
            "etp": consecutive(16, 2),
            "ep": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
            "etp_ep": [list(range(8)), list(range(8, 16))],
            "edp": singletons(16),
        },
    ),
    "H": (
        dict(world_size=16, tp=2, pp=2, etp=1, ep=2, order=TP_PP_DP_ORDER),
        {
            "tp": consecutive(16, 2),
            "dp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
            "pp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
            "ep": consecutive(16, 2),
            "edp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
        },
    ),
}


@pytest.mark.parametrize("example", sorted(WORKED_EXAMPLES))
def test_worked_example_groups_match_megatron(example):
    sizes, expected_groups = WORKED_EXAMPLES[example]
    dims = ParallelDims(**sizes)
    for name, expected in expected_groups.items():
        assert dims.groups(name) == expected, f"example {example}, group {name}"


# Example A's per-rank table (E=8, two local experts): tp, dp, etp, ep, edp rank, local experts.
EXAMPLE_A_RANKS = [
    (0, 0, 0, 0, 0, [0, 1]),
    (1, 0, 0, 1, 0, [2, 3]),
    (0, 1, 0, 2, 0, [4, 5]),
    (1, 1, 0, 3, 0, [6, 7]),
    (0, 2, 0, 0, 1, [0, 1]),
    (1, 2, 0, 1, 1, [2, 3]),
    (0, 3, 0, 2, 1, [4, 5]),
    (1, 3, 0, 3, 1, [6, 7]),
]


def test_example_a_per_rank_table():
    dims = ParallelDims(8, tp=2, etp=1, ep=4)
    for rank, (tp, dp, etp, ep, edp, experts) in enumerate(EXAMPLE_A_RANKS):
        coords = dims.coords(rank)
        assert (coords.tp, coords.dp, coords.etp, coords.ep, coords.edp) == (tp, dp, etp, ep, edp), rank
        assert list(dims.local_experts(rank, num_experts=8)) == experts, rank


def test_example_c_per_rank_formulas():
    dims = ParallelDims(16, tp=2, etp=1, ep=8)
    for rank in range(16):
        coords = dims.coords(rank)
        assert (coords.tp, coords.dp, coords.etp, coords.ep, coords.edp) == (
            rank % 2,
            rank // 2,
            0,
            rank % 8,
            rank // 8,
        )
        assert list(dims.local_experts(rank, num_experts=16)) == [2 * (rank % 8), 2 * (rank % 8) + 1]


def test_describe_and_defaults():
    dims = ParallelDims(8, tp=2, etp=1, ep=4)
    assert str(dims) == dims.describe() == "world 8: dense TP2 CP1 DP4 PP1 | expert ETP1 EP4 EDP2 PP1"
    assert "(order tp-cp-ep-pp-dp)" in ParallelDims(4, tp=2, order=TP_PP_DP_ORDER).describe()
    assert ParallelDims(8, tp=2, ep=2).etp == 2  # Megatron: etp defaults to tp
    assert ParallelDims(8, order=" TP-CP-EP-DP-PP ").order == DEFAULT_ORDER


def test_immutable_picklable_and_returns_copies():
    dims = ParallelDims(8, tp=2, etp=1, ep=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dims.tp = 4
    dims.groups("tp")[0].append(99)
    assert dims.groups("tp")[0] == [0, 1]
    assert pickle.loads(pickle.dumps(dims)) == dims == copy.deepcopy(dims)
    assert hash(dims) == hash(ParallelDims(8, tp=2, etp=1, ep=4))


# ---------------------------------------------------------------------------------------------
# Independent oracle: the RankGenerator algorithm as docs/numerics.md §14 states it

# Group name -> (generator, axes the group spans); the expert generator reads tp as ETP, dp as EDP.
MEGATRON_GROUPS = {
    "tp": ("dense", "tp"),
    "cp": ("dense", "cp"),
    "dp": ("dense", "dp"),
    "dp_cp": ("dense", "dp-cp"),
    "tp_cp": ("dense", "tp-cp"),
    "tp_dp_cp": ("dense", "tp-dp-cp"),
    "pp": ("dense", "pp"),
    "tp_pp": ("dense", "tp-pp"),
    "ep": ("expert", "ep"),
    "etp": ("expert", "tp"),
    "edp": ("expert", "dp"),
    "etp_ep": ("expert", "tp-ep"),
    "etp_ep_pp": ("expert", "tp-ep-pp"),
}


def reference_get_ranks(order: list[str], sizes: dict[str, int], token: str) -> list[list[int]]:
    """Groups enumerated by the unmasked coordinates, members by the masked ones, first axis fastest."""
    strides, stride = {}, 1
    for axis in order:
        strides[axis], stride = stride, stride * sizes[axis]
    masked = [axis for axis in order if axis in token.split("-")]
    unmasked = [axis for axis in order if axis not in masked]

    def mixed_radix(index: int, axes: list[str]) -> int:
        rank = 0
        for axis in axes:  # first axis fastest
            rank += (index % sizes[axis]) * strides[axis]
            index //= sizes[axis]
        return rank

    group_size = 1
    for axis in masked:
        group_size *= sizes[axis]
    return [
        [mixed_radix(group, unmasked) + mixed_radix(member, masked) for member in range(group_size)]
        for group in range(stride // group_size)
    ]


def test_groups_equal_the_reference_algorithm_without_sorting():
    # The reference lists are not sorted by the algorithm; equality shows ours are Megatron's lists
    # in Megatron's order (its enumeration is already ascending).
    for world, tp, cp, pp, ep, etp, order in all_valid_layouts(16):
        dims = ParallelDims(world, tp, cp, pp, ep, etp, order)
        generators = {
            "dense": {"tp": tp, "cp": cp, "ep": 1, "dp": dims.dp, "pp": pp},
            "expert": {"tp": etp, "cp": 1, "ep": ep, "dp": dims.edp, "pp": pp},
        }
        for name, (side, token) in MEGATRON_GROUPS.items():
            expected = reference_get_ranks(order.split("-"), generators[side], token)
            assert dims.groups(name) == expected, (dims, name)


# ---------------------------------------------------------------------------------------------
# Invariants over every valid layout

# Group name -> (coordinate fields of that side, fields the group spans).
_DENSE_FIELDS = ("tp", "cp", "dp", "pp")
_EXPERT_FIELDS = ("etp", "ep", "edp", "pp")
GROUP_FIELDS = {
    "tp": (_DENSE_FIELDS, ("tp",)),
    "cp": (_DENSE_FIELDS, ("cp",)),
    "dp": (_DENSE_FIELDS, ("dp",)),
    "dp_cp": (_DENSE_FIELDS, ("dp", "cp")),
    "tp_cp": (_DENSE_FIELDS, ("tp", "cp")),
    "tp_dp_cp": (_DENSE_FIELDS, ("tp", "dp", "cp")),
    "pp": (_DENSE_FIELDS, ("pp",)),
    "tp_pp": (_DENSE_FIELDS, ("tp", "pp")),
    "ep": (_EXPERT_FIELDS, ("ep",)),
    "etp": (_EXPERT_FIELDS, ("etp",)),
    "edp": (_EXPERT_FIELDS, ("edp",)),
    "etp_ep": (_EXPERT_FIELDS, ("etp", "ep")),
    "etp_ep_pp": (_EXPERT_FIELDS, ("etp", "ep", "pp")),
}


# The expert side's coordinate fields and the order-string axes they live on.
_AXIS_OF_FIELD = {"etp": "tp", "edp": "dp"}


def test_group_fields_table_covers_every_name():
    assert set(GROUP_FIELDS) == set(GROUP_NAMES)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def all_valid_layouts(max_world: int):
    """Every (world, tp, cp, pp, ep, etp, order) ParallelDims accepts, for both Megatron orders."""
    for world in range(1, max_world + 1):
        for pp in _divisors(world):
            for tp, etp in itertools.product(_divisors(world // pp), repeat=2):
                for cp in _divisors(world // (pp * tp)):
                    for ep in _divisors(world // (pp * etp)):
                        yield world, tp, cp, pp, ep, etp, DEFAULT_ORDER
                        if pp == 1 or tp * cp == etp * ep:
                            yield world, tp, cp, pp, ep, etp, TP_PP_DP_ORDER


def check_layout_invariants(dims: ParallelDims) -> None:
    world = dims.world_size
    coords = [dims.coords(rank) for rank in range(world)]
    tables = {name: dims.groups(name) for name in GROUP_NAMES}
    axis_order = dims.order.split("-")
    for name, groups in tables.items():
        side_fields, spanned = GROUP_FIELDS[name]
        size = 1
        for field in spanned:
            size *= getattr(dims, field)
        # A partition of the world into sorted groups of the axis product, listed by first rank.
        assert sorted(rank for group in groups for rank in group) == list(range(world)), name
        assert all(len(group) == size for group in groups), name
        assert all(group == sorted(group) for group in groups), name
        assert [group[0] for group in groups] == sorted(group[0] for group in groups), name
        fixed = [field for field in side_fields if field not in spanned]
        # Within a group the spanned axes vary in order-string order, the first fastest.
        spanned = sorted(spanned, key=lambda field: axis_order.index(_AXIS_OF_FIELD.get(field, field)))
        for group in groups:
            # Members share every coordinate of their side outside the group, differ inside it,
            # and group rank i has the spanned coordinates of index i (first axis fastest).
            assert len({tuple(getattr(coords[r], f) for f in fixed) for r in group}) == 1, name
            for index, rank in enumerate(group):
                expected, rest = {}, index
                for field in spanned:
                    expected[field], rest = rest % getattr(dims, field), rest // getattr(dims, field)
                assert {f: getattr(coords[rank], f) for f in spanned} == expected, (name, rank)
            assert dims.group_of(name, group[-1]) == group, name
    # Dense and expert pipeline stages are the same ranks: a pp group shares its expert coordinates.
    for group in tables["pp"]:
        assert len({(coords[r].etp, coords[r].ep, coords[r].edp) for r in group}) == 1
    # Folding: an expert communication group never leaves one dense pipeline stage.
    stage_of = {rank: index for index, group in enumerate(tables["tp_dp_cp"]) for rank in group}
    for group in tables["etp_ep"]:
        assert len({stage_of[rank] for rank in group}) == 1
        # etp x ep structure: the union of its members' etp groups and of their ep groups.
        assert sorted({r for m in group for r in dims.group_of("etp", m)}) == group
        assert sorted({r for m in group for r in dims.group_of("ep", m)}) == group
    # Each mesh line along a dim is one group of the matching name.
    for kind in ("dense", "expert"):
        layout = dims.mesh_layout(kind)
        for dim, name in enumerate(layout.dim_names):
            others = [range(size) if d != dim else range(1) for d, size in enumerate(layout.sizes)]
            lines = []
            for start in itertools.product(*others):
                base = sum(i * stride for i, stride in zip(start, layout.strides))
                lines.append([base + i * layout.strides[dim] for i in range(layout.sizes[dim])])
            assert sorted(lines) == tables[name], (kind, name)
    # Experts: each EP group holds every expert exactly once.
    num_experts = 2 * dims.ep
    for group in tables["ep"]:
        held = [e for rank in group for e in dims.local_experts(rank, num_experts)]
        assert held == list(range(num_experts))


def _check(layout) -> None:
    dims = ParallelDims(*layout)
    try:
        check_layout_invariants(dims)
    except AssertionError as error:
        raise AssertionError(f"{dims!r}: {error}") from error


def test_invariants_every_layout_up_to_world_16():
    layouts = list(all_valid_layouts(16))
    assert len(layouts) > 2500
    for layout in layouts:
        _check(layout)


def test_invariants_sampled_layouts_up_to_world_64():
    # Every layout up to 64 ranks is ~48k of them (too slow to check all); a fixed sample of the
    # larger worlds, plus each world's most and least split layouts, keeps this test a few seconds.
    larger = [layout for layout in all_valid_layouts(64) if layout[0] > 16]
    sample = random.Random(0).sample(larger, 600)
    for world in range(17, 65):
        sample.append((world, 1, 1, 1, 1, 1, DEFAULT_ORDER))
        sample.append((world, world, 1, 1, 1, world, DEFAULT_ORDER))
        sample.append((world, 1, 1, 1, world, 1, DEFAULT_ORDER))
    for layout in sample:
        _check(layout)


def test_every_accepted_axis_permutation_keeps_the_invariants():
    accepted = 0
    for order in itertools.permutations(AXES):
        try:
            dims = ParallelDims(16, tp=2, pp=2, etp=1, ep=4, order="-".join(order))
        except ValueError as error:
            assert "pipeline groups differ" in str(error)
            assert order[-1] != "pp"
            continue
        accepted += 1
        check_layout_invariants(dims)
    assert accepted >= 24  # at least every order with pp last


# ---------------------------------------------------------------------------------------------
# Errors


def test_world_not_divisible_by_dense_product():
    with pytest.raises(
        ValueError, match=r"world_size=8 is not divisible by tp\*cp\*pp = 3 .*one of \[1, 2, 4, 8\]"
    ):
        ParallelDims(8, tp=3)


def test_world_not_divisible_by_expert_product():
    with pytest.raises(ValueError, match=r"not divisible by etp\*ep\*pp = 3 .*ep must divide 8"):
        ParallelDims(8, ep=3)


def test_expert_error_explains_the_etp_default():
    with pytest.raises(ValueError, match=r"etp\*ep\*pp = 8 .*etp defaults to tp=2; pass etp=1"):
        ParallelDims(4, tp=2, ep=4)


@pytest.mark.parametrize("size", ["world_size", "tp", "cp", "pp", "ep", "etp"])
def test_sizes_below_one(size):
    sizes = {"world_size": 8, size: 0}
    with pytest.raises(ValueError, match=rf"{size} must be >= 1, got 0"):
        ParallelDims(**sizes)


def test_non_integer_size():
    with pytest.raises(TypeError, match=r"tp must be an int, got float 2.0"):
        ParallelDims(8, tp=2.0)
    with pytest.raises(TypeError, match=r"ep must be an int, got bool"):
        ParallelDims(8, ep=True)


@pytest.mark.parametrize(
    ("order", "problem"),
    [
        ("tp-cp-xp-dp-pp", r"unknown axis 'xp'"),
        ("tp-cp-ep-dp-dp", r"duplicate axis 'dp'; missing axis 'pp'"),
        ("tp-cp-ep-dp", r"missing axis 'pp'; 4 axes instead of 5"),
        ("tp-cp-ep-dp-pp-tp", r"duplicate axis 'tp'; 6 axes instead of 5"),
        ("tp_cp_ep_dp_pp", r"unknown axis 'tp_cp_ep_dp_pp'"),
        (None, r"order must be a string"),
    ],
)
def test_malformed_order(order, problem):
    with pytest.raises(ValueError, match=rf"{problem}.*'tp-cp-ep-dp-pp' \(default\) or 'tp-cp-ep-pp-dp'"):
        ParallelDims(8, order=order)


def test_dense_and_expert_pipeline_groups_differ():
    # Example H with EP=4: EDP=2 != DP=4 under the tp-cp-ep-pp-dp order.
    with pytest.raises(ValueError, match=r"pipeline groups differ .*dp=4.*edp=2.*'tp-cp-ep-dp-pp'"):
        ParallelDims(16, tp=2, pp=2, etp=1, ep=4, order=TP_PP_DP_ORDER)


def test_num_experts_not_divisible_by_ep():
    dims = ParallelDims(8, etp=1, ep=4)
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by ep=4.*ep values work: \[1, 2\]"):
        dims.validate_num_experts(6)
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by ep=4"):
        dims.local_experts(0, 6)
    with pytest.raises(ValueError, match=r"num_experts must be >= 1"):
        dims.validate_num_experts(0)
    dims.validate_num_experts(8)
    assert dims.num_local_experts(8) == 2


def test_lookup_errors():
    dims = ParallelDims(8, tp=2)
    with pytest.raises(ValueError, match=r"unknown group name 'mp'; expected one of tp, cp"):
        dims.groups("mp")
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 8\), got 8"):
        dims.coords(8)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 8\), got -1"):
        dims.group_of("tp", -1)
    with pytest.raises(ValueError, match=r"mesh kind must be 'dense' or 'expert'"):
        dims.mesh_layout("moe")
