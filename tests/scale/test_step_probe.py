"""The step probe itself: it sees collectives with their groups and reductions, one read per ``.tolist()``,
refuses reads it has no answer for, and follows live bytes (the oracle of test_fake_step.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mod_tracker import ModTracker

from lightning_moe import MoEConfig
from lightning_moe.layers.dispatch import local_expert_counts
from lightning_moe.planning.fake_world import fake_rank
from lightning_moe.planning.step_probe import StepProbe


def test_probe_records_collectives_reads_and_bytes():
    config = MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2)
    with fake_rank(5, 8):
        group = dist.new_group([4, 5, 6, 7])
        tracker = ModTracker()
        probe = StepProbe({"dispatch.py:local_expert_counts": 3}, tracker)
        with FakeTensorMode(), tracker, probe, probe.patched():
            x = torch.zeros(256, dtype=torch.float32)  # 1 KiB
            assert probe.live == 1024
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
            funcol.all_reduce(x, "sum", group)  # the functional op DTensor uses
            # The product reads the [E] counts with one .tolist(): one read, answered element-wise.
            assert local_expert_counts(torch.zeros(6, 4, dtype=torch.bool), config) == [3, 3, 3, 3]
            with pytest.raises(AssertionError, match="unexpected host read at a site outside lightning_moe"):
                x.sum().item()
            del x
            assert probe.live < 1024
    record = probe.record
    assert [(c.kind, c.ranks, c.backward, c.op) for c in record.collectives] == [
        ("all_reduce", (4, 5, 6, 7), False, "max"), ("all_reduce", (4, 5, 6, 7), False, "sum"),
    ]
    assert [read.site for read in record.host_reads] == ["dispatch.py:local_expert_counts"]
