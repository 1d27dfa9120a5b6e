"""`lightning-moe plan` as a user runs it: the command, its JSON, sizes, the search, a real preset."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re

import pytest
from scale.formula import local_parameters

from lightning_moe import cli_plan
from lightning_moe.cli import cli_main
from lightning_moe.models import MoETransformerConfig
from lightning_moe.parallel import ParallelDims
from lightning_moe.planning import Layout, PlanConfigError, parse_bytes, plan, planner

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs")
TINY = os.path.join(EXAMPLES, "tiny_cpu.yaml")
_STEPS: dict = {}


@pytest.fixture(autouse=True)
def _plan_each_rank_once(monkeypatch):
    """The tests plan the same few configurations: each rank's fake step runs once per module (the
    report, the JSON and the search are what differ)."""
    real = planner.fake_fit_steps

    def cached(args, rank, world_size, *, imbalance=1.0, measure_step=1, objects=None, cut=None, microbatches=None):
        key = (tuple(args), rank, world_size, imbalance, measure_step, cut, microbatches)
        if key not in _STEPS:
            _STEPS[key] = real(args, rank, world_size, imbalance=imbalance, measure_step=measure_step, objects=objects,
                               cut=cut, microbatches=microbatches)
        return copy.deepcopy(_STEPS[key])

    monkeypatch.setattr(planner, "fake_fit_steps", cached)
    monkeypatch.setattr(planner, "default_jobs", lambda num_ranks: 1)  # the cache lives in this process


def test_plan_json_holds_the_largest_rank_and_the_fit(capsys):
    result = cli_main(["plan", "--config", TINY, "--json", "--gpu_memory", "1MB"])
    printed = json.loads(capsys.readouterr().out)  # stdout is the JSON object alone
    per_rank = printed["per_rank"]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "peak_bytes"):
        assert per_rank[key] == result.largest.bytes()[key] and per_rank[key] > 0
    assert per_rank["peak_bytes"] == (per_rank["params_bytes"] + per_rank["grads_bytes"] + per_rank["optimizer_bytes"]
                                      + per_rank["activation_bytes"])
    layout = printed["layout"]
    assert (layout["world_size"], layout["tensor_parallel_size"], layout["expert_parallel_size"]) == (4, 2, 4)
    assert printed["gpu_memory_bytes"] == 10**6 and printed["fits"] is False
    assert printed["headroom_bytes"] == 10**6 - per_rank["peak_bytes"]
    assert printed["communication_bytes"]["token_dispatch"] > 0  # EP=4 moves tokens
    assert printed["communication_bytes"]["pipeline"] == 0


def test_plan_text_says_whether_it_fits(capsys):
    cli_main(["plan", "--config", TINY, "--gpu_memory=1GB", "--imbalance", "2"])
    text = capsys.readouterr().out
    assert "fits in 953.67 MiB: yes" in text and "routing imbalance 2" in text
    assert "peak" in text and "token dispatch" in text


def test_imbalance_grows_only_what_routing_sizes():
    balanced, skewed = plan(["--config", TINY], imbalance=1.0), plan(["--config", TINY], imbalance=2.0)
    b, s = balanced.largest.bytes(), skewed.largest.bytes()
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert b[key] == s[key]
    assert s["activation_bytes"] > b["activation_bytes"]
    # The growth is the dispatchers' (the rows each expert receives), and they are part of the activations.
    assert 0 < b["dispatch_bytes"] < s["dispatch_bytes"] <= s["activation_bytes"]
    assert skewed.largest.communication["token_dispatch"] > balanced.largest.communication["token_dispatch"]


@pytest.mark.parametrize(("text", "expected"), [
    ("80GB", 80 * 10**9), ("96GiB", 96 * 2**30), ("141e9", 141 * 10**9), ("512 MiB", 512 * 2**20), (1024, 1024),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_refuses_what_it_cannot_read():
    with pytest.raises(PlanConfigError, match="80GB"):
        parse_bytes("eighty gigs")


def test_a_bad_layout_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["plan", "--config", TINY, "--trainer.strategy.init_args.expert_parallel_size=3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lightning-moe plan: error:") and "\n" not in err
    assert "EP=3" in err and "one of [1, 2, 4]" in err  # what is wrong and what would do


def test_search_ranks_the_layouts_that_fit_first(monkeypatch, capsys):
    # Two layouts of the tiny configuration (planning every layout of world 4 takes minutes).
    candidates = [Layout(tp=2, ep=4), Layout(tp=1, ep=4, sharding_strategy="FULL_SHARD")]
    monkeypatch.setattr(cli_plan, "valid_layouts", lambda *args, **kwargs: candidates)
    ranked = cli_main(["plan", "--config", TINY, "--search", "--gpu_memory", "4.5MiB"])
    peaks = {layout: p.largest.step.peak_bytes for layout, p in ranked}
    fits = [layout for layout, p in ranked if p.fits]
    assert [layout for layout, _ in ranked] == sorted(candidates, key=lambda x: (peaks[x] > 4.5 * 2**20, peaks[x]))
    out = capsys.readouterr().out
    assert f"{len(fits)} of 2 layouts fit" in out
    assert out.count("lightning-moe fit") == 2  # the command line of each
    assert "--trainer.strategy.init_args.sharding_strategy=FULL_SHARD" in out


def test_search_goes_on_past_a_layout_it_cannot_plan(monkeypatch, capsys):
    """A layout whose planning fails (a planner bug, not a refused configuration) is reported and left
    out; the layouts planned before and after it are still ranked (a search of a large model runs
    for many minutes)."""
    candidates = [Layout(tp=1, ep=4, sharding_strategy="FULL_SHARD"), Layout(tp=2, ep=4)]
    monkeypatch.setattr(cli_plan, "valid_layouts", lambda *args, **kwargs: candidates)
    real_plan = cli_plan.plan

    def plan_or_fail(args, **kwargs):
        if "--trainer.strategy.init_args.sharding_strategy=FULL_SHARD" in args:
            raise RuntimeError("planning a rank failed in a worker process:\nTraceback ...\n  File x\nValueError: boom")
        return real_plan(args, **kwargs)

    monkeypatch.setattr(cli_plan, "plan", plan_or_fail)
    ranked = cli_main(["plan", "--config", TINY, "--search"])
    assert [layout for layout, _ in ranked] == [candidates[1]]
    err = capsys.readouterr().err
    assert "could not plan: RuntimeError: ValueError: boom" in err  # what failed, not the traceback's start
    assert re.search(r"warning: .*could not plan 1 of 2 layouts \(first: .*FULL_SHARD.*boom", err)
    with pytest.warns(UserWarning, match=r"could not plan 1 of 2 layouts"):  # the API, without progress
        assert [layout for layout, _ in cli_plan.search_layouts(["--config", TINY])] == [candidates[1]]


def test_mixtral_on_64_gpus_holds_the_layouts_parameters():
    """The Mixtral-8x7B plan (8 nodes x 8 GPUs, TP=8, EP=8, bf16-mixed) holds the layout's arithmetic
    (`scale.formula`) in fp32 master weights: 5,838,999,552 parameters per rank for the preset's 32
    blocks. Planned here with 2 of its blocks (every shape the preset's; the whole model takes half a
    minute): the rank's parameters are the formula's for those 2 blocks, which is linear in the blocks."""
    from models.test_presets import load_preset

    config: MoETransformerConfig = load_preset("mixtral_8x7b")
    dims = ParallelDims(64, tp=8, ep=8, etp=1)
    assert local_parameters(config, dims) == 5_838_999_552
    result = plan(["--config", os.path.join(EXAMPLES, "plan", "mixtral_8x7b_64gpu.yaml"), "--model.model.num_layers=2"])
    two_blocks = dataclasses.replace(config, num_layers=2)
    assert result.largest.step.params_bytes == 4 * local_parameters(two_blocks, dims)
    assert result.precision == "bf16-mixed" and result.layout()["world_size"] == 64


def test_plan_help_describes_every_option(capsys):
    """``lightning-moe plan --help``: each of plan's own options with what it does, and fit's overrides."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["plan", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--config" in text and "%%" not in text
    text = text.split("options:", 1)[1]
    for option, words in {"--gpu_memory": "fits", "--imbalance": "share", "--json": "JSON", "--search": "layout",
                          "--search_top": "how many", "--fast": "middle pipeline stages", "--jobs": "forked"}.items():
        assert f"{option} " in text, option
        described = text.split(f"{option} ", 1)[1][:400]
        assert words in described, (option, described)
