"""What the all-to-all dispatcher costs besides the all-to-alls themselves.

* Drop-and-pad checks once that every rank holds the same number of tokens (its split sizes are
  static), not on every forward: counted by wrapping the size exchange. Unequal counts are a
  ``ValueError`` naming them, on every device (read on the host once, not a device assert).
* The expert-major order of the received rows is a permutation (every row once), which lets the
  experts scatter back with ``index_copy``; the metadata says so, and it holds.
"""

from __future__ import annotations

import pytest
import torch
from helpers.dist import run_distributed

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize
from lightning_moe.parallel.dispatchers import AllToAllDispatcher, alltoall

pytestmark = pytest.mark.distributed

FORWARDS = 3


def _layer(**overrides) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(MoEConfig(16, 8, 8, top_k=2, **overrides))


def _count_size_exchanges(rank: int, world: int) -> dict:
    ctx = build_parallel_context(ParallelDims(world, ep=world), "cpu")
    layer = parallelize(_layer(capacity_factor=1.0, pad_to_capacity=True), ctx)
    calls = []
    original = alltoall.gather_sizes

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    alltoall.gather_sizes = counting
    try:
        for step in range(FORWARDS):
            x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(10 * rank + step), requires_grad=True)
            layer(x).sum().backward()
    finally:
        alltoall.gather_sizes = original
    unequal = parallelize(_layer(capacity_factor=1.0, pad_to_capacity=True), ctx)
    try:
        unequal(torch.randn(2 + rank, 4, 16))
    except ValueError as err:
        return {"calls": len(calls), "error": str(err)}
    return {"calls": len(calls), "error": None}


def test_drop_and_pad_checks_token_counts_once(tmp_path):
    ranks = run_distributed(_count_size_exchanges, 2, timeout_s=60, tmp_dir=tmp_path)
    assert [r["calls"] for r in ranks] == [1, 1]
    for r in ranks:
        assert "needs the same number of tokens on every rank" in r["error"]
        assert "got token counts [8, 12] over the ETP x EP group" in r["error"]


def test_unequal_token_counts_raise_on_the_host_on_accelerators_too(monkeypatch):
    """A routing map on another device than the CPU (here ``meta``) gets the same ValueError."""
    monkeypatch.setattr(alltoall, "gather_sizes", lambda local, group: torch.tensor([[8], [12]]))
    routing_map = torch.empty(8, 8, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"got token counts \[8, 12\] over the ETP x EP group"):
        AllToAllDispatcher._check_equal_token_counts(type("Dispatcher", (), {"etp_ep_group": None})(), routing_map)


def _received_order(rank: int, world: int, etp: int) -> dict:
    ctx = build_parallel_context(ParallelDims(world, ep=world // etp, etp=etp), "cpu")
    layer = parallelize(_layer(), ctx)
    x = torch.randn(10 + 3 * rank, 16, generator=torch.Generator().manual_seed(rank))
    probs, routing_map = layer.router(x)
    rows, counts, _, metadata = layer.dispatcher.dispatch(x, probs, routing_map)
    order = metadata.row_index
    return {
        "flag": metadata.row_index_is_permutation,
        "is_permutation": order is None or torch.equal(order.sort().values, torch.arange(rows.shape[0])),
        "rows": rows.shape[0], "counted": sum(counts),
    }


@pytest.mark.parametrize("etp", [1, 2], ids=["ep2", "ep1-etp2"])
def test_received_rows_are_reordered_by_a_permutation(tmp_path, etp):
    for r in run_distributed(_received_order, 2, etp, timeout_s=60, tmp_dir=tmp_path):
        assert r["flag"] and r["is_permutation"] and r["rows"] == r["counted"]
