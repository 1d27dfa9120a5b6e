"""Setting up one rank of a real preset allocates its shard and, beside it, at most one tensor.

As ``MoEStrategy`` does: the model is built on the meta device, parallelised, and
``materialize`` gives this rank's shards storage and draws their values. Under ``FakeTensorMode``
nothing is allocated, but every storage the setup creates is counted
(`helpers.live_bytes.LiveBytes`), on the fake backend (`scale.fake_world`) as rank ``r`` of the world.

Oracle, from the model's global shapes and the config: the bytes the rank holds afterwards (its
parameters and buffers) plus the largest single tensor that initialisation draws in full so that
every layout starts from the one-device values: a dense weight's global fp32 tensor, or one
expert's fc1 (its full SwiGLU width; each expert is drawn from its own generator). The setup peak
may exceed the shard by that much and no more: never a layer's experts, never the model.

What this cannot show: the device allocator (caching, fragmentation) and the host copy of the
drawn tensor on a GPU machine; ``benchmarks/gpu_check.sh`` should compare
``torch.cuda.max_memory_allocated`` after setup with the rank's shard on a GPU.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers.live_bytes import LiveBytes, held_bytes
from models.test_presets import load_preset
from scale.fake_world import fake_rank
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_moe.layers.activations import is_gated
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize
from lightning_moe.strategies.model_setup import materialize

FP32 = 4  # initial values are drawn in fp32 whatever the parameters' dtype

MOE_LAYERS = 2
"""MoE blocks kept of each preset (after its dense ones): every tensor keeps the preset's shape, and
the bound is per tensor, so more blocks of the same shapes would repeat the check (and cost seconds
of fake dispatch each)."""

# (preset, layout, sharding): the layouts a user would pick, covering EP, ETP (fc1 blocks of an
# expert), FSDP2 on top of TP (strided DTensor shards) and multi-latent attention with shared experts.
LAYOUTS = [
    ("mixtral_8x7b", ParallelDims(world_size=64, tp=8, ep=8, etp=1), "NO_SHARD"),
    ("mixtral_8x7b", ParallelDims(world_size=64, tp=8, ep=4, etp=2), "NO_SHARD"),
    ("qwen3_30b_a3b", ParallelDims(world_size=128, tp=4, ep=32, etp=1), "FULL_SHARD"),
    ("deepseek_v3_style", ParallelDims(world_size=1024, tp=8, ep=64, etp=1), "NO_SHARD"),
]
IDS = [f"{name}-w{d.world_size}-tp{d.tp}-ep{d.ep}-etp{d.etp}-{s.lower()}" for name, d, s in LAYOUTS]


def largest_draw_bytes(model: torch.nn.Module, config: MoETransformerConfig) -> int:
    """The largest tensor initialisation draws in full: a dense weight's global shape or one
    expert's fc1 (``2F x H`` when gated), in fp32."""
    moe = config.moe
    expert_fc1 = moe.ffn_hidden_size * moe.hidden_size * (2 if is_gated(moe.activation) else 1)
    dense = max(p.numel() for name, p in model.named_parameters() if ".experts." not in name)
    return FP32 * max(expert_fc1, dense)


@pytest.mark.parametrize(("name", "dims", "sharding"), LAYOUTS, ids=IDS)
def test_setup_peak_is_the_shard_plus_one_tensor(name, dims, sharding):
    """The last rank (every coordinate non-zero; the last, smaller shards where FSDP2 splits unevenly)."""
    config = load_preset(name)
    config = replace(config, num_layers=config.first_dense_layers + MOE_LAYERS)
    rank = dims.world_size - 1
    with fake_rank(rank, dims.world_size):
        with torch.device("meta"):
            model = MoETransformer(config)
        parallelize(model, build_parallel_context(dims, "cpu"), sharding_strategy=sharding)
        assert held_bytes(model) == 0  # built on the meta device: nothing allocated yet
        with FakeTensorMode(allow_non_fake_inputs=True), LiveBytes() as setup:
            materialize(model, torch.device("cpu"))
        shard, draw = held_bytes(model), largest_draw_bytes(model, config)
    assert shard > 0 and setup.live == shard, (setup.live, shard)  # only the shard stays
    assert setup.peak <= shard + draw, (
        f"setup peak {setup.peak / 2**30:.2f} GiB is the shard {shard / 2**30:.2f} GiB plus "
        f"{(setup.peak - shard) / 2**30:.2f} GiB; at most the largest drawn tensor ({draw / 2**30:.2f} GiB) may be added"
    )
