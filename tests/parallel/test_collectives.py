"""`parallel.collectives`: uneven all-to-all / all-gather / reduce-scatter and their adjoints, on gloo ranks.

Every rank builds every rank's inputs from a per-rank seed, so each rank can compute the exact
expected output of a collective by hand. Values are small integers stored as floats: sums are exact
in any order, so forward values and gradients are compared with ``torch.equal``.

Backward is checked two ways: against the hand-routed gradient (the adjoint collective applied to
the output gradient), and through the adjoint identity ``<A x, g> == <x, A^T g>`` summed over the
group (``A^T g`` is what autograd put in ``x.grad``).

Cases cover equal sizes (the flat all-gather / reduce-scatter path), uneven sizes, a rank with 0
rows, a subgroup (group ranks differ from global ranks) and a one-rank group (identity shortcut).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed

from lightning_moe.parallel.collectives import all_gather_v, all_to_all, gather_sizes, reduce_scatter_v

pytestmark = pytest.mark.distributed

# Trailing shape of every row: more than one trailing dim checks the reshapes inside the collectives.
ROW_SHAPE = (3, 2)
# Integer-valued floats keep every sum exact, so comparisons are exact (torch.equal).
VALUE_RANGE = 10


def _data(seed: int, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-VALUE_RANGE, VALUE_RANGE, (rows, *ROW_SHAPE), generator=gen).float()


def _adjoint_gap(y: torch.Tensor, g: torch.Tensor, x: torch.Tensor, group) -> float:
    """``<A x, g> - <x, A^T g>`` summed over the group (exact for integer data)."""
    dots = torch.stack([(y.detach() * g).sum(), (x.detach() * x.grad).sum()]).double()
    dist.all_reduce(dots, group=group)
    return (dots[0] - dots[1]).item()


# -- per-collective checks; ``members`` are the global ranks of ``group`` in group-rank order ------------


def _check_all_to_all(group, members: list[int], splits: list[list[int]], seed: int) -> None:
    """``splits[s][d]``: rows group rank ``s`` sends to group rank ``d``."""
    me = members.index(dist.get_rank())
    world = len(members)
    xs = [_data(seed + s, sum(splits[s])) for s in range(world)]
    gs = [_data(seed + 100 + d, sum(splits[s][d] for s in range(world))) for d in range(world)]

    def block(tensors, owner, index, sizes):
        start = sum(sizes[owner][:index])
        return tensors[owner][start : start + sizes[owner][index]]

    input_splits = splits[me]
    output_splits = [splits[s][me] for s in range(world)]
    x = xs[me].clone().requires_grad_()
    y = all_to_all(x, output_splits, input_splits, group)
    expected = torch.cat([block(xs, s, me, splits) for s in range(world)])
    assert torch.equal(y, expected), f"all_to_all forward, splits {splits}"

    y.backward(gs[me])
    # Rank d received from s the block at position s of its output; the gradient of our block
    # sent to d is that block of g_d.
    received = [[splits[s][d] for s in range(world)] for d in range(world)]
    expected_grad = torch.cat([block(gs, d, me, received) for d in range(world)])
    assert torch.equal(x.grad, expected_grad), f"all_to_all backward, splits {splits}"
    assert _adjoint_gap(y, gs[me], x, group) == 0.0


def _check_all_gather_v(group, members: list[int], sizes: list[int], seed: int) -> None:
    me = members.index(dist.get_rank())
    world = len(members)
    xs = [_data(seed + r, sizes[r]) for r in range(world)]
    gs = [_data(seed + 100 + r, sum(sizes)) for r in range(world)]

    x = xs[me].clone().requires_grad_()
    y = all_gather_v(x, sizes, group)
    assert torch.equal(y, torch.cat(xs)), f"all_gather_v forward, sizes {sizes}"

    y.backward(gs[me])
    start = sum(sizes[:me])
    expected_grad = sum(g[start : start + sizes[me]] for g in gs)
    assert torch.equal(x.grad, expected_grad), f"all_gather_v backward, sizes {sizes}"
    assert _adjoint_gap(y, gs[me], x, group) == 0.0


def _check_reduce_scatter_v(group, members: list[int], sizes: list[int], seed: int) -> None:
    me = members.index(dist.get_rank())
    world = len(members)
    xs = [_data(seed + r, sum(sizes)) for r in range(world)]
    gs = [_data(seed + 100 + r, sizes[r]) for r in range(world)]

    x = xs[me].clone().requires_grad_()
    y = reduce_scatter_v(x, sizes, group)
    start = sum(sizes[:me])
    expected = sum(t[start : start + sizes[me]] for t in xs)
    assert y.shape == (sizes[me], *ROW_SHAPE)
    assert torch.equal(y, expected), f"reduce_scatter_v forward, sizes {sizes}"

    y.backward(gs[me])
    assert torch.equal(x.grad, torch.cat(gs)), f"reduce_scatter_v backward, sizes {sizes}"
    assert _adjoint_gap(y, gs[me], x, group) == 0.0


def _check_gather_sizes(group, members: list[int]) -> None:
    me = members.index(dist.get_rank())
    world = len(members)
    for shape in [(1,), (5,), (2, 3)]:
        local = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).view(shape) * 10 + me
        out = gather_sizes(local, group)
        assert out.shape == (world, *shape) and out.dtype == torch.int64
        for r in range(world):
            assert torch.equal(out[r], local - me + r), (shape, r)


def _check_identity_on_one_rank(group) -> None:
    """A one-rank group returns the input itself: no copy, no collective."""
    x = _data(7, 4)
    assert all_to_all(x, [4], [4], group) is x
    assert all_gather_v(x, [4], group) is x
    assert reduce_scatter_v(x, [4], group) is x
    assert torch.equal(gather_sizes(torch.tensor([3, 4]), group), torch.tensor([[3, 4]]))


# -- cases -----------------------------------------------------------------------------------------------

# splits[s][d] per world size: equal, uneven with zero blocks, a rank that sends and receives nothing.
A2A_SPLITS = {
    2: [
        [[2, 2], [2, 2]],
        [[1, 3], [0, 2]],
        [[0, 0], [4, 0]],  # rank 0 sends nothing, rank 1 receives nothing
    ],
    4: [
        [[1, 1, 1, 1]] * 4,
        [[2, 0, 1, 3], [0, 0, 0, 5], [1, 2, 0, 0], [4, 1, 2, 1]],
        [[0, 3, 0, 1], [0, 0, 0, 0], [0, 2, 2, 0], [0, 1, 0, 3]],  # rank 1: sends 0, receives 6
    ],
}
# Row counts per rank: equal sizes take the flat all-gather / reduce-scatter; uneven ones the all-to-all.
V_SIZES = {2: [[3, 3], [1, 4], [0, 5], [2, 0]], 4: [[2, 2, 2, 2], [1, 3, 0, 2], [0, 0, 4, 1], [5, 1, 1, 1]]}


def _collectives_on_ranks(rank: int, world_size: int) -> str:
    world = dist.group.WORLD
    everyone = list(range(world_size))
    # Every rank must create every group, members or not, in the same order.
    singles = [dist.new_group([r]) for r in range(world_size)]
    halves = None
    if world_size == 4:
        # Strided pairs {0, 2}, {1, 3}: group rank != global rank on ranks 1 and 2.
        pairs = [[0, 2], [1, 3]]
        groups = [dist.new_group(p) for p in pairs]
        halves = next((g, p) for g, p in zip(groups, pairs) if rank in p)

    seed = 0
    for splits in A2A_SPLITS[world_size]:
        _check_all_to_all(world, everyone, splits, seed := seed + 1000)
    for sizes in V_SIZES[world_size]:
        _check_all_gather_v(world, everyone, sizes, seed := seed + 1000)
        _check_reduce_scatter_v(world, everyone, sizes, seed := seed + 1000)
    _check_gather_sizes(world, everyone)
    if halves is not None:
        group, members = halves
        for splits in A2A_SPLITS[2]:
            _check_all_to_all(group, members, splits, seed := seed + 1000)
        for sizes in V_SIZES[2]:
            _check_all_gather_v(group, members, sizes, seed := seed + 1000)
            _check_reduce_scatter_v(group, members, sizes, seed := seed + 1000)
        _check_gather_sizes(group, members)
    _check_identity_on_one_rank(singles[rank])
    return "ok"


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_forward_and_adjoint(world_size, tmp_path):
    assert (
        run_distributed(_collectives_on_ranks, world_size, timeout_s=120, tmp_dir=tmp_path)
        == ["ok"] * world_size
    )
