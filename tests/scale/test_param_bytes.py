"""Per-rank parameter, gradient and optimizer bytes of the real presets at world 64-1024.

Each preset of ``examples/configs/models/`` is built on the meta device and parallelised as one
rank of the layout a user would pick, on the fake backend (`scale.fake_world`); the elements that
rank holds are compared with `scale.formula.local_parameters`, written from the config fields.

Pipeline parallelism: ``parallelize`` does not split stages; ``PipelineRunner`` trims the model to
this rank's stages afterwards, as the strategy does, and the stage is counted then. FSDP2 ``FULL_SHARD`` works on the fake
backend with meta parameters and is checked for the layouts whose dimensions divide evenly.
"""

from __future__ import annotations

import pytest
import torch
from models.test_presets import EXACT
from scale.fake_world import local_numel, sharded_preset
from scale.formula import global_parameters, local_parameters, training_state_bytes
from torch.distributed.fsdp import FSDPModule

from lightning_moe.parallel import ParallelDims
from lightning_moe.parallel.pipeline.runner import PipelineRunner
from lightning_moe.planning.fake_world import fake_rank

# (preset, layout): what a user would pick for each model at its scale.
LAYOUTS = [
    ("mixtral_8x7b", ParallelDims(world_size=64, tp=8, ep=8, etp=1)),
    ("mixtral_8x7b", ParallelDims(world_size=64, tp=8, ep=4, etp=2)),
    ("qwen3_30b_a3b", ParallelDims(world_size=128, tp=4, ep=32, etp=1)),
    ("deepseek_v3_style", ParallelDims(world_size=1024, tp=8, ep=64, etp=1)),
    # Long sequences: context parallelism shards activations only; under FULL_SHARD dense
    # parameters shard over DP x CP.
    ("qwen3_30b_a3b", ParallelDims(world_size=128, tp=4, cp=2, ep=32, etp=1)),
]


def layout_id(name: str, dims: ParallelDims) -> str:
    """A short test id: preset and sizes."""
    return f"{name}-w{dims.world_size}-tp{dims.tp}-cp{dims.cp}-ep{dims.ep}-etp{dims.etp}-pp{dims.pp}"


IDS = [layout_id(name, dims) for name, dims in LAYOUTS]


def _expert_param(name: str) -> bool:
    return ".experts." in name


@pytest.mark.parametrize(("name", "dims"), LAYOUTS, ids=IDS)
def test_local_parameters_match_the_formula(name, dims):
    """First and last rank hold exactly the formula's elements; the layout's global count is the
    published one (tests/models/test_presets.py::EXACT)."""
    for rank in (0, dims.world_size - 1):
        with fake_rank(rank, dims.world_size):
            sharded = sharded_preset(name, dims, rank)
            assert sharded.local_parameters() == local_parameters(sharded.config, dims), (name, rank)
            # Dense DTensors know their global shape; each routed expert lives on one EP x ETP
            # coordinate, so the experts' global count is the local one times EP x ETP.
            total = sum(
                local_numel(p) * dims.ep * dims.etp if _expert_param(n) else p.numel()
                for n, p in sharded.model.named_parameters()
            )
    assert total == global_parameters(sharded.config) == EXACT[name][0]


def test_formula_is_the_whole_model_at_world_one():
    """The oracle itself: at world 1 it is the published count of every preset tested."""
    from models.test_presets import load_preset

    for name in {name for name, _ in LAYOUTS}:
        assert global_parameters(load_preset(name)) == EXACT[name][0]


# Every sharded dimension of these divides evenly over DP / EDP. Not DeepSeek-V3 at DP=128: its
# kv_down_proj has 576 rows, which FSDP2 splits unevenly (padded shards), so the even formula does
# not apply there.
FSDP_LAYOUTS = [LAYOUTS[0], LAYOUTS[2], LAYOUTS[4]]


@pytest.mark.parametrize(("name", "dims"), FSDP_LAYOUTS, ids=[IDS[0], IDS[2], IDS[4]])
def test_full_shard_local_parameters_and_training_state(name, dims):
    """Under FULL_SHARD a rank holds the formula's shard, and AdamW (run one step on meta, with
    gradients made here in the shards' shape) keeps two moments of each local shard: the parameter
    and optimizer bytes of `training_state_bytes`."""
    rank = dims.world_size // 2 + 1
    with fake_rank(rank, dims.world_size):
        sharded = sharded_preset(name, dims, rank, "FULL_SHARD")
        local = sharded.local_parameters()
        assert local == local_parameters(sharded.config, dims, fsdp=True)
        params = [p for p in sharded.model.parameters()]
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer = torch.optim.AdamW(params, foreach=False)
        optimizer.step()
        moments = sum(
            local_numel(v) * v.element_size()
            for state in optimizer.state.values()
            for v in state.values()
            if torch.is_tensor(v) and v.dim() > 0  # not the scalar step counter
        )
        param_bytes = sum(local_numel(p) * p.element_size() for p in params)
    expected = training_state_bytes(local)
    assert (param_bytes, moments) == (expected["params"], expected["optimizer"])


def test_full_shard_has_one_root():
    """One FSDP2 root drives the streams so backward prefetches the previous block's all-gather: the
    model itself is a unit (every other unit is inside it), with no parameters of its own here (the
    embedding, norm and head are units of their own, so they are freed between uses)."""
    name, dims = LAYOUTS[0]
    with fake_rank(0, dims.world_size):
        sharded = sharded_preset(name, dims, 0, "FULL_SHARD")
        assert isinstance(sharded.model, FSDPModule)
        assert not sharded.model._get_fsdp_state()._fsdp_param_groups


def test_training_state_bytes():
    """fp32 Adam: parameters, gradients and two moments, 16 bytes per element; bf16 weights with
    fp32 gradients and moments (no master copy counted here) 14."""
    assert training_state_bytes(10) == {"params": 40, "grads": 40, "optimizer": 80, "total": 160}
    assert training_state_bytes(10, param_bytes=2)["total"] == 140
    # Deferred reduction at DP=4: unsharded gradients, 4x the shard, between micro-batches.
    assert training_state_bytes(10, grad_elements=40) == {"params": 40, "grads": 160, "optimizer": 80, "total": 280}


def _even_split(num_layers: int, stages: int, stage: int) -> range:
    """Blocks of ``stage`` when ``num_layers`` are split as evenly as possible, earlier stages first."""
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


PP_LAYOUTS = [
    ("mixtral_8x7b", ParallelDims(world_size=128, tp=8, ep=8, etp=1, pp=2)),
    ("deepseek_v3_style", ParallelDims(world_size=1024, tp=8, ep=64, etp=1, pp=8)),
]


@pytest.mark.parametrize(("name", "dims"), PP_LAYOUTS, ids=[layout_id(n, d) for n, d in PP_LAYOUTS])
def test_pipeline_stage_parameters_match_the_formula(name, dims):
    """After ``parallelize`` and the 1F1B ``PipelineRunner`` trims the model, the first and the last
    rank hold their stage's blocks (even split; DeepSeek-V3's 61 over 8: 8,8,8,8,8,7,7,7) and the
    embedding or the head, as the formula says."""
    for rank in (0, dims.world_size - 1):
        stage = dims.coords(rank).pp
        with fake_rank(rank, dims.world_size):
            sharded = sharded_preset(name, dims, rank)
            PipelineRunner(sharded.model, sharded.ctx, "1F1B", dims.pp, lambda out, _: out.sum(), torch.device("cpu"))
            layers = _even_split(sharded.config.num_layers, dims.pp, stage)
            expected = local_parameters(
                sharded.config, dims, layers=layers, first=stage == 0, last=stage == dims.pp - 1
            )
            assert sharded.local_parameters() == expected, (name, rank, stage)


def test_state_dict_returns_only_the_held_expert_elements():
    """Mixtral at world 64, TP=8, EP=4, ETP=2: ``state_dict()`` hands out the expert elements this
    rank holds, no more (today 1.67x: fc1 is gathered to full width)."""
    name, dims = LAYOUTS[1]
    with fake_rank(3, dims.world_size):
        sharded = sharded_preset(name, dims, 3)
        held = sum(local_numel(p) for n, p in sharded.model.named_parameters() if _expert_param(n))
        state = sharded.model.state_dict()
        out = sum(local_numel(v) for k, v in state.items() if _expert_param(k))
    assert out == held, f"state_dict() returns {out} expert elements, {out / held:.2f}x the {held} held"
