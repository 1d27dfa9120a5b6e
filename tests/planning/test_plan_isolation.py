"""Planning leaves the caller's process as it found it: the planner runs a configuration's setup
(its ``seed_everything``, Lightning's environment variables, the strategy's rank and warning
filters) inside the caller's process, and a test or notebook that plans goes on afterwards."""

from __future__ import annotations

import os
import random
import warnings

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only

from lightning_moe.planning.fake_fit import fake_fit_rank
from lightning_moe.planning.plan_config import read_layout

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "tiny_cpu.yaml")


def _state():
    return (dict(os.environ), torch.random.get_rng_state(), random.getstate(), getattr(rank_zero_only, "rank", None),
            list(warnings.filters))


def _assert_same(before, after):
    env, rng, py_rng, rank, filters = before
    assert after[0] == env  # no PL_GLOBAL_SEED or other variable left behind
    assert torch.equal(after[1], rng) and after[2] == py_rng
    assert after[3] == rank and after[4] == filters


def test_reading_a_layout_keeps_the_callers_state():
    before = _state()
    read_layout(["--config", TINY])
    _assert_same(before, _state())


def test_planning_a_rank_keeps_the_callers_state():
    before = _state()
    fake_fit_rank(["--config", TINY], 3, 4)  # a rank other than 0: MoEStrategy sets rank_zero_only.rank
    _assert_same(before, _state())
