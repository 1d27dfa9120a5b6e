"""A stage's repeated blocks planned from runs with one and two of them equal the run with all.

The oracle is the planner's default (``plan(args)``: every block run), itself checked
against real runs in ``test_plan_vs_measured.py``. The layouts are those of the real-run check with
more blocks: a pipeline stage of five MoE blocks after a dense one, FSDP2 (whose step peaks in the
forward for many blocks and in the backward for few, so the peak is extrapolated per phase), and
context parallelism.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from helpers.step_memory import TINY_LAYOUTS
from torch import nn

from lightning_moe.parallel.pipeline.split import PipelineParts
from lightning_moe.planning import plan
from lightning_moe.planning.repeated_blocks import BlockCut, _cheapest_cut, cut_blocks

pytestmark = pytest.mark.distributed

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "tiny_cpu.yaml")
_M = "--model.model."
CASES = {
    "pp2-dense-then-moe": [*TINY_LAYOUTS["pp2-ep2"], f"{_M}num_layers=10", f"{_M}first_dense_layers=1"],
    "full-shard": [*TINY_LAYOUTS["full-shard-ep4"], f"{_M}num_layers=6"],
    "cp2-ep2": [*TINY_LAYOUTS["cp2-ep2"], f"{_M}num_layers=6"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_extrapolated_blocks_equal_every_block_run(name):
    args = ["--config", CONFIG, *CASES[name]]
    cut, exact = plan(args, jobs=1, fast=True), plan(args, jobs=1)
    assert any(s.step.cut_blocks for s in cut.stages), "the case must cut blocks to test anything"
    for a, b in zip(cut.stages, exact.stages, strict=True):
        assert not b.step.cut_blocks
        want, got = b.bytes(), a.bytes()
        # The dispatchers' share of the peak is the layer's running then, not extrapolated (only the total is).
        assert {k: v for k, v in got.items() if k != "dispatch_bytes"} == \
            {k: v for k, v in want.items() if k != "dispatch_bytes"}, (name, a.stage)
        assert a.communication == b.communication, (name, a.stage)


def test_a_kind_is_cut_only_where_that_saves_work():
    # Blocks run, each run's setup counted as one: 8 of one kind: 1 + 2 blocks in two runs.
    assert _cheapest_cut(Counter({0: 8})) == (0,)
    # DeepSeek-V3's first stage of 8: 3 dense and 5 MoE blocks; cutting either costs more than it saves.
    assert _cheapest_cut(Counter({0: 3, 1: 5})) == ()
    assert _cheapest_cut(Counter({0: 4})) == ()  # 2 runs of 1 and 2 blocks cost what 1 run of 4 does
    assert _cheapest_cut(Counter({0: 1, 1: 47})) == (1,)  # Qwen3-30B-A3B-like: all but the few


class _Blocks(nn.Module):
    def __init__(self, widths):
        super().__init__()
        self.embed, self.head = nn.Linear(4, 4), nn.Linear(4, 4)
        self.layers = nn.ModuleList(nn.Linear(4, w) if w != 4 else nn.Linear(4, 4) for w in widths)

    def pipeline_parts(self):
        return PipelineParts(blocks="layers", first=("embed",), last=("head",), embed=self.embed,
                             block=lambda layer, x: layer(x), head=self.head)


class _Module(nn.Module):
    def __init__(self, widths):
        super().__init__()
        self.net = _Blocks(widths)


def test_the_cut_keeps_the_first_blocks_of_each_kind_of_this_ranks_stage():
    widths = [8, *[4] * 6, 4, *[8] * 6]  # stage 0: 8 and six 4s; stage 1: 4 and six 8s
    module = _Module(widths)
    blocks = list(module.net.layers)
    held, split = cut_blocks(module, 1, 2, 1, None, BlockCut(grown=1))
    assert held == {1: 6}  # stage 1's kinds in order: Linear(4, 4) once (kept whole), Linear(4, 8) six times
    assert split == [7, 3]
    assert list(module.net.layers) == [*blocks[:7], blocks[7], blocks[8], blocks[9]]
    plain = nn.Sequential(nn.Linear(2, 2))  # no pipeline parts: nothing is cut
    assert cut_blocks(plain, 0, 1, 1, None, BlockCut()) == ({}, None)
