"""Planning layouts: `valid_layouts` against a brute-force oracle, cross-node warnings against hand-written
groups, the fit command through ``shlex.split`` and ``MoEStrategy`` itself."""

from __future__ import annotations

import importlib
import itertools
import shlex

import pytest

from lightning_moe.parallel import ParallelDims
from lightning_moe.planning import (
    STRATEGY_CLASS_PATH,
    Layout,
    command_line,
    cross_node_warnings,
    valid_layouts,
)

# ---------------------------------------------------------------------------------------------- oracle

# Stages each pipeline rank holds by schedule when virtual_stages is None (MoEStrategy's docs).
_DEFAULT_VIRTUAL = {"1F1B": 1, "GPipe": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2}


def admitted(world: int, tp: int, cp: int, pp: int, ep: int, etp: int, sharding: str, m: dict) -> bool:
    """The model and data constraints, written from what each parallelism cuts."""
    if m["num_experts"] % ep:  # every EP rank holds the same number of experts
        return False
    if m.get("expert_ffn_hidden_size") and m["expert_ffn_hidden_size"] % etp:  # ETP cuts each expert's F
        return False
    # fc2_bias cuts nothing: every ETP rank holds it whole and one of them adds it.
    if tp > 1:
        kv = m["num_kv_heads"] or m["num_attention_heads"]
        widths = [m["num_attention_heads"], kv, m.get("vocab_size"), m.get("ffn_hidden_size")]
        if any(w is not None and w % tp for w in widths) or m.get("tie_embeddings"):
            return False
    seq = m["seq_len"]
    if cp > 1 and seq % (2 * cp):  # two equal chunks per CP rank
        return False
    if (seq // cp) % tp:  # each rank's tokens in TP equal slices (sequence parallelism)
        return False
    schedule = m.get("pipeline_schedule", "1F1B")
    if pp > 1:
        virtual = m.get("virtual_stages") or _DEFAULT_VIRTUAL[schedule]
        if m["num_layers"] < pp * virtual:  # every stage needs a block
            return False
        if m["batch_size"] % (m.get("num_microbatches") or 1):
            return False
        if schedule == "ZBVZeroBubble" and sharding != "NO_SHARD":
            return False
    edp = world // (etp * ep * pp)
    hidden = m.get("hidden_size")
    return not (sharding != "NO_SHARD" and hidden is not None and hidden % edp)


def oracle(world: int, m: dict, shardings: tuple[str, ...]) -> set[Layout]:
    """Every tuple of divisors that ParallelDims folds, kept by :func:`admitted`."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    layouts = set()
    for tp, cp, pp, ep, etp in itertools.product(divisors, repeat=5):
        try:
            ParallelDims(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
        except ValueError:
            continue
        layouts.update(Layout(tp, cp, pp, ep, etp, s) for s in shardings if admitted(world, tp, cp, pp, ep, etp, s, m))
    return layouts


def foldable(world: int) -> int:
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return sum(
        world % (tp * cp * pp) == 0 and world % (etp * ep * pp) == 0
        for tp, cp, pp, ep, etp in itertools.product(divisors, repeat=5)
    )


CASES = {
    "world8": (8, dict(num_experts=4, num_attention_heads=4, num_kv_heads=2, num_layers=4, seq_len=24,
                       batch_size=4, num_microbatches=2), ("NO_SHARD", "FULL_SHARD")),
    "world16_zbv": (16, dict(num_experts=8, num_attention_heads=8, num_kv_heads=None, num_layers=4, seq_len=32,
                             batch_size=6, num_microbatches=3, vocab_size=100, ffn_hidden_size=48,
                             expert_ffn_hidden_size=6, hidden_size=12, pipeline_schedule="ZBVZeroBubble"),
                    ("NO_SHARD", "FULL_SHARD")),
    "world16_microbatches": (16, dict(num_experts=16, num_attention_heads=16, num_kv_heads=4, num_layers=16,
                                      seq_len=64, batch_size=6, num_microbatches=4), ("NO_SHARD", "FULL_SHARD")),
    "world12_interleaved": (12, dict(num_experts=6, num_attention_heads=6, num_kv_heads=3, num_layers=4, seq_len=36,
                                     batch_size=4, fc2_bias=True, tie_embeddings=True,
                                     pipeline_schedule="Interleaved1F1B", virtual_stages=2),
                            ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_valid_layouts_match_brute_force(case):
    world, model, shardings = CASES[case]
    expected = oracle(world, model, shardings)
    got = valid_layouts(world, **model, sharding_strategies=shardings)
    assert len(got) == len(set(got)), "a layout is listed twice"
    assert set(got) == expected, (
        f"missing {sorted(map(str, expected - set(got)))}; extra {sorted(map(str, set(got) - expected))}"
    )
    # The constraints bite (not every foldable layout passes) and leave something to choose from.
    assert 0 < len(expected) < foldable(world) * len(shardings)


def test_fc2_bias_keeps_the_expert_tensor_parallel_layouts():
    model = dict(num_experts=4, num_attention_heads=4, num_kv_heads=2, num_layers=4, seq_len=24, batch_size=4,
                 expert_ffn_hidden_size=8)
    with_bias = valid_layouts(8, **model, fc2_bias=True)
    assert with_bias == valid_layouts(8, **model)
    assert any(layout.etp > 1 for layout in with_bias)


def test_valid_layouts_refuse_bad_inputs_at_once():
    model = dict(num_experts=4, num_attention_heads=4, num_kv_heads=2, num_layers=4, seq_len=24, batch_size=4)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        valid_layouts(8, **model, num_microbatches=0)
    with pytest.raises(ValueError, match="sharding_strategy"):
        valid_layouts(8, **model, sharding_strategies=("ZERO3",))
    with pytest.raises(ValueError, match="seq_len must be an int >= 1"):
        valid_layouts(8, **{**model, "seq_len": 0})


def test_deepseek_v3_sizes_on_1024_ranks_enumerate():
    world = 1024
    layouts = valid_layouts(
        world, num_experts=256, num_attention_heads=128, num_kv_heads=128, num_layers=61, seq_len=4096,
        batch_size=16, vocab_size=129280, ffn_hidden_size=18432, expert_ffn_hidden_size=2048, hidden_size=7168,
        num_microbatches=8,
    )
    for layout in layouts:
        dims = layout.dims(world)
        assert dims.world_size == world and 256 % dims.ep == 0
    # DeepSeek-V3's own training layout (PP16 x EP64, no TP) at this world size.
    assert Layout(tp=1, cp=1, pp=16, ep=64, etp=1) in layouts


# ---------------------------------------------------------------------------------------------- Layout

def test_layout_describes_builds_and_validates():
    layout = Layout(tp=2, ep=4)
    assert layout.describe() == "TP=2 CP=1 PP=1 EP=4 ETP=1 NO_SHARD" == str(layout)
    assert layout.dims(8) == ParallelDims(8, tp=2, ep=4, etp=1)
    for bad in (dict(tp=0), dict(ep=True), dict(cp=1.0)):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            Layout(**bad)
    with pytest.raises(ValueError, match="sharding_strategy"):
        Layout(sharding_strategy="ZERO3")


def test_strategy_args_are_what_moe_strategy_takes():
    from lightning_moe.strategies import MoEStrategy

    layout = Layout(tp=2, cp=2, pp=2, ep=4, etp=1, sharding_strategy="FULL_SHARD")
    strategy = MoEStrategy(**layout.strategy_args())
    assert strategy.sizes == {"tp": 2, "cp": 2, "pp": 2, "ep": 4, "etp": 1}
    assert strategy.sharding_strategy == "FULL_SHARD"
    module, name = STRATEGY_CLASS_PATH.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is MoEStrategy


# ---------------------------------------------------------------------------------------------- cross-node

def blocks(world: int, size: int) -> list[list[int]]:
    return [list(range(start, start + size)) for start in range(0, world, size)]


def strided(world: int, stride: int, size: int) -> list[list[int]]:
    """Groups ``{base + k*stride}`` of ``size`` members, ``base`` over each block of ``stride*size`` ranks."""
    return [
        [start + offset + k * stride for k in range(size)]
        for start in range(0, world, stride * size) for offset in range(stride)
    ]


# (ParallelDims sizes, devices per node, hand-written groups of each kind, fix text of each kind that warns).
NODE_CASES = {
    "tp8_fits": (dict(tp=8, etp=1), 8, {"tp": blocks(16, 8), "cp": blocks(16, 1), "ep": blocks(16, 1),
                                         "etp": blocks(16, 1)}, {}),
    "tp16_spans": (dict(tp=16, etp=1), 8, {"tp": blocks(16, 16), "cp": blocks(16, 1), "ep": blocks(16, 1),
                                            "etp": blocks(16, 1)}, {"tp": "Make TP (now 16) divide 8"}),
    "ep16_spans": (dict(ep=16, etp=1), 8, {"tp": blocks(16, 1), "cp": blocks(16, 1), "ep": blocks(16, 16),
                                            "etp": blocks(16, 1)}, {"ep": "Make EP (now 16) divide 8"}),
    "ep8_strided_by_etp": (dict(tp=2, ep=8, etp=2), 8, {"tp": blocks(16, 2), "cp": blocks(16, 1),
                                                        "ep": strided(16, 2, 8), "etp": blocks(16, 2)},
                           {"ep": "Make ETP*EP (now 2*8 = 16) divide 8"}),
    "cp_strided_by_tp": (dict(tp=4, cp=4, etp=1), 8, {"tp": blocks(16, 4), "cp": strided(16, 4, 4),
                                                      "ep": blocks(16, 1), "etp": blocks(16, 1)},
                         {"cp": "Make TP*CP (now 4*4 = 16) divide 8"}),
    "pp_across_nodes_is_fine": (dict(tp=2, cp=2, pp=2, ep=4, etp=2), 8,
                                {"tp": blocks(16, 2), "cp": strided(16, 2, 2), "ep": strided(16, 2, 4),
                                 "etp": blocks(16, 2)}, {}),
    "tp4_on_6_per_node": (dict(tp=4, etp=1), 6, {"tp": blocks(16, 4), "cp": blocks(16, 1), "ep": blocks(16, 1),
                                                 "etp": blocks(16, 1)}, {"tp": "Make TP (now 4) divide 6"}),
}
LABELS = {"tp": "TP", "cp": "CP", "ep": "EP", "etp": "ETP"}


@pytest.mark.parametrize("case", list(NODE_CASES))
def test_cross_node_warnings_follow_group_membership(case):
    sizes, per_node, groups, fixes = NODE_CASES[case]
    dims = ParallelDims(16, **sizes)
    for kind, members in groups.items():
        assert dims.groups(kind) == members, f"the hand-written {kind} groups are not the layout's"
    spanning = [k for k, members in groups.items() if any(len({r // per_node for r in g}) > 1 for g in members)]
    assert sorted(spanning) == sorted(fixes), "the case's expected fixes do not match its groups"
    warnings = cross_node_warnings(dims, per_node)
    assert [w.split()[0] for w in warnings] == [LABELS[k] for k in LABELS if k in spanning]
    for kind, warning in zip([k for k in LABELS if k in spanning], warnings):
        size = len(groups[kind][0])
        nodes = max(len({r // per_node for r in g}) for g in groups[kind])
        assert f"span up to {nodes} nodes" in warning and f"{size} ranks each" in warning
        assert f"{per_node} devices per node" in warning and fixes[kind] in warning


def test_cross_node_warnings_refuse_bad_devices_per_node():
    with pytest.raises(ValueError, match="devices_per_node must be an int >= 1"):
        cross_node_warnings(ParallelDims(8), 0)


# ---------------------------------------------------------------------------------------------- command line

def test_command_line_round_trips_through_shlex():
    base = ["--config", "my runs/x.yaml", "--trainer.logger.init_args.name=it's a \"test\"", "--seed_everything=1"]
    layout = Layout(tp=2, cp=1, pp=4, ep=8, etp=2, sharding_strategy="FULL_SHARD")
    tokens = shlex.split(command_line(base, layout))
    assert tokens[:3] == ["lightning-moe", "fit", f"--trainer.strategy={STRATEGY_CLASS_PATH}"]
    assert tokens[3:3 + len(base)] == base
    prefix = "--trainer.strategy.init_args."
    overrides = dict(t[len(prefix):].split("=", 1) for t in tokens[3 + len(base):])
    assert all(t.startswith(prefix) for t in tokens[3 + len(base):])
    assert overrides == {
        "tensor_parallel_size": "2", "context_parallel_size": "1", "pipeline_parallel_size": "4",
        "expert_parallel_size": "8", "expert_tensor_parallel_size": "2", "sharding_strategy": "FULL_SHARD",
    }
    with pytest.raises(TypeError, match="list of arguments"):
        command_line("--config x.yaml", layout)
