"""`classify_collective`: each collective of a step counted under the kind a user reads it as."""

from __future__ import annotations

import pytest

from lightning_moe.parallel import ParallelDims
from lightning_moe.planning.planner import COMMUNICATION_KINDS, classify_collective, communication_bytes
from lightning_moe.planning.step_probe import Collective

DIMS = ParallelDims(16, tp=2, cp=2, ep=4)  # rank 0: TP (0, 1), CP (0, 2), DP x CP of the dense side
RANK = 0
GROUPS = {name: tuple(DIMS.group_of(name, RANK)) for name in ("tp", "cp", "dp", "dp_cp", "edp")}


def _c(kind, ranks, site="", module=None, sent=8):
    return Collective(kind, tuple(ranks), False, module, site, (1,), "sum" if kind in ("all_reduce", "reduce_scatter") else "",
                      8, sent)


@pytest.mark.parametrize(("collective", "fsdp", "kind"), [
    (_c("send", GROUPS["cp"], site="ring.py", module="layers.0"), False, "context_parallel"),
    (_c("recv", (0, 8), site="runner.py"), False, "pipeline"),
    (_c("all_to_all", (0, 1, 2, 3), site="collectives.py", module="layers.3"), False, "token_dispatch"),
    (_c("all_gather", (0, 1), site="collectives.py", module="layers.1"), False, "token_dispatch"),  # ETP gather
    (_c("all_reduce", GROUPS["dp_cp"], site="grad_sync.py"), False, "gradient_reduction"),
    (_c("reduce_scatter", GROUPS["tp"], site="moe_strategy.py", module="layers.0"), True, "tensor_parallel"),
    (_c("all_gather", GROUPS["dp_cp"], site="transformer.py", module="layers.0"), True, "fsdp"),
    (_c("all_gather", GROUPS["dp_cp"], site="transformer.py", module="layers.0"), False, "other"),  # no FSDP2
    (_c("all_reduce", GROUPS["cp"], site="apply.py"), False, "context_parallel"),
    (_c("all_reduce", tuple(range(16)), site="grad_norm.py"), False, "other"),
])
def test_each_collective_has_its_kind(collective, fsdp, kind):
    assert classify_collective(collective, GROUPS, fsdp) == kind


def test_sent_bytes_are_summed_per_kind_and_every_kind_is_reported():
    steps = [_c("all_to_all", (0, 1, 2, 3), sent=100), _c("all_to_all", (0, 1, 2, 3), sent=50),
             _c("send", (0, 8), site="runner.py", sent=7)]
    totals = communication_bytes(steps, DIMS, RANK, "NO_SHARD")
    assert set(totals) == set(COMMUNICATION_KINDS)
    assert totals["token_dispatch"] == 150 and totals["pipeline"] == 7 and sum(totals.values()) == 157
