"""The bytes a rank sends per collective, for every op form torch.distributed issues, against the
ring/pairwise arithmetic written out here (each collective moving a tensor of known size)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mod_tracker import ModTracker

from lightning_moe.planning.fake_world import fake_rank
from lightning_moe.planning.step_probe import StepProbe

N = 4  # group size; this process is rank 5 of 8, index 1 in the group [4, 5, 6, 7]
KIB = 1024


def _sent(run) -> list[tuple[str, int]]:
    with fake_rank(5, 8):
        group = dist.new_group([4, 5, 6, 7])
        one = dist.new_group([5])
        tracker = ModTracker()
        probe = StepProbe({}, tracker)
        with FakeTensorMode(), tracker, probe, probe.patched():
            run(group, one)
    return [(c.kind, c.sent_bytes) for c in probe.record.collectives]


def _kib(n: int = 1) -> torch.Tensor:
    return torch.zeros(256 * n)  # n KiB of fp32


def test_reductions_send_what_a_ring_moves():
    def run(group, one):
        dist.all_reduce(_kib(8), group=group)
        funcol.all_reduce(_kib(8), "sum", group)
        dist.reduce_scatter_single(_kib(2), _kib(8), group=group)  # in-place: output first
        funcol.reduce_scatter_single(_kib(8), "sum", 0, group)
        dist.all_reduce(_kib(8), group=one)

    assert _sent(run) == [
        ("all_reduce", 2 * (N - 1) * 8 * KIB // N), ("all_reduce", 2 * (N - 1) * 8 * KIB // N),
        ("reduce_scatter", (N - 1) * 8 * KIB // N), ("reduce_scatter", (N - 1) * 8 * KIB // N),
        ("all_reduce", 0),  # a group of one rank sends nothing
    ]


def test_gathers_send_the_shard_to_every_other_rank():
    def run(group, one):
        dist.all_gather_single(_kib(8), _kib(2), group=group)  # in-place: output first
        funcol.all_gather_single(_kib(2), 0, group)
        dist.all_gather([_kib(2) for _ in range(N)], _kib(2), group=group)

    assert _sent(run) == [("all_gather", (N - 1) * 2 * KIB)] * 3


def test_all_to_all_keeps_the_rows_addressed_to_this_rank():
    row = 16 * 4  # 16 fp32 per row

    def run(group, one):
        dist.all_to_all_single(torch.zeros(8, 16), torch.zeros(8, 16), group=group)  # equal shares
        # Rows per destination: 1, 5 (this rank, index 1), 0, 2.
        dist.all_to_all_single(torch.zeros(8, 16), torch.zeros(8, 16), [2, 2, 2, 2], [1, 5, 0, 2], group=group)
        funcol.all_to_all_single(torch.zeros(8, 16), [2, 2, 2, 2], [1, 5, 0, 2], group)
        dist.all_to_all([torch.zeros(i + 1, 16) for i in range(N)], [torch.zeros(i + 1, 16) for i in range(N)],
                        group=group)

    assert _sent(run) == [
        ("all_to_all", 6 * row), ("all_to_all", 3 * row), ("all_to_all", 3 * row),
        ("all_to_all", (1 + 3 + 4) * row),  # the list form: every tensor but this rank's (2 rows)
    ]


def test_point_to_point_and_broadcast():
    def run(group, one):
        dist.send(_kib(3), dst=6)
        dist.recv(_kib(3), src=4)
        dist.broadcast(_kib(8), src=4, group=group)

    assert _sent(run) == [("send", 3 * KIB), ("recv", 0), ("broadcast", (N - 1) * 8 * KIB // N)]
