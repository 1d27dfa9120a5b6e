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

import math
from dataclasses import replace

import pytest
import torch
from models.test_presets import load_preset
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_moe.layers.activations import is_gated
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize
from lightning_moe.parallel.sharded_init import local_block, write_sharded
from lightning_moe.planning.fake_world import fake_rank
from lightning_moe.planning.live_bytes import LiveBytes, held_bytes
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


# (mesh sizes, global shape, placements): tensor-parallel shards, two shards of one dimension,
# uneven shards.
BLOCK_CASES = [
    ((2, 4), (64, 3), (Replicate(), Shard(0))),
    ((2, 4), (64, 6), (Shard(1), Shard(0))),
    ((4, 2), (37, 5), (Shard(0), Shard(0))),
]


@pytest.mark.parametrize(("mesh_shape", "shape", "placements"), BLOCK_CASES, ids=[str(c[2]) for c in BLOCK_CASES])
def test_write_sharded_cuts_what_dtensor_cuts(mesh_shape, shape, placements):
    """Each value is its global index: on every rank, the shard written from the full values equals
    the one ``distribute_tensor`` cuts; with ``index`` too (one expert of a stack whose dimension 0 is
    not sharded)."""
    world = math.prod(mesh_shape)
    values = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    stacked = torch.stack([values, -values])
    stacked_placements = tuple(Shard(p.dim + 1) if isinstance(p, Shard) else p for p in placements)
    for rank in range(world):
        with fake_rank(rank, world):
            mesh = init_device_mesh("cpu", mesh_shape)
            weight = distribute_tensor(torch.zeros(shape), mesh, placements, src_data_rank=None)
            write_sharded(weight, values)
            want = distribute_tensor(values, mesh, placements, src_data_rank=None).to_local()
            assert torch.equal(weight.to_local(), want), rank
            experts = distribute_tensor(torch.zeros(stacked.shape), mesh, stacked_placements, src_data_rank=None)
            for index in range(2):
                write_sharded(experts, stacked[index], index=index)
            want = distribute_tensor(stacked, mesh, stacked_placements, src_data_rank=None).to_local()
            assert torch.equal(experts.to_local(), want), rank


# (DP, TP, rows, ranks): FSDP2 over a tensor-parallel row shard, uneven: 129 rows leave TP shards of
# 33 and 30 rows, and DP shards of 5, 3, 0 and 4, 2 rows; DeepSeek-V3's vocabulary of 129280 leaves
# 31 rows on the last DP rank.
FSDP_TP_CASES = [(8, 4, 129, range(32)), (128, 8, 129280, (0, 517, 1023))]


@pytest.mark.parametrize(("dp", "tp", "rows", "ranks"), FSDP_TP_CASES, ids=["129-rows", "deepseek-vocab"])
def test_write_sharded_fills_fsdp2_shards_over_tensor_parallelism(dp, tp, rows, ranks):
    """Oracle: the shard FSDP2 keeps of a tensor-parallel weight that held the values (each value its
    global index). Its placements are strided; for uneven sizes ``distribute_tensor`` would cut
    other rows (it interleaves), FSDP2 cuts each TP shard's rows in DP parts. Each rank's weight
    gets a shape of its own: FSDP2 DTensors of one shape keep the mesh of the first fake rank that
    built one in this process."""
    for columns, rank in enumerate(ranks, start=1):
        values = torch.arange(rows * columns, dtype=torch.float32).reshape(rows, columns)
        with fake_rank(rank, dp * tp):
            mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            held, written = (_fsdp_over_tp(start, mesh) for start in (values, torch.zeros_like(values)))
            assert isinstance(written.placements[0], _StridedShard)
            write_sharded(written, values)
            assert torch.equal(written.to_local(), held.to_local()), rank


def _fsdp_over_tp(values: torch.Tensor, mesh) -> torch.Tensor:
    linear = torch.nn.Linear(values.shape[1], values.shape[0], bias=False)
    linear.weight = torch.nn.Parameter(distribute_tensor(values, mesh["tp"], (Shard(0),), src_data_rank=None))
    fully_shard(linear, mesh=mesh["dp"])
    return linear.weight


def test_a_shard_that_is_not_one_block_is_cut_by_dtensor():
    """Strided placements that are not FSDP2's (rows 0 and 2 of 4 on one rank) fall back to
    ``distribute_tensor``; the written shard is the one it cuts. With ``index`` they are refused."""
    values = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)
    placements = (Shard(0), _StridedShard(0, split_factor=2))
    for rank in range(4):
        with fake_rank(rank, 4):
            mesh = init_device_mesh("cpu", (2, 2))
            weight = distribute_tensor(torch.zeros(4, 3), mesh, placements, src_data_rank=None)
            assert local_block(weight) is None
            write_sharded(weight, values)
            want = distribute_tensor(values, mesh, placements, src_data_rank=None).to_local()
            assert torch.equal(weight.to_local(), want), rank
            with pytest.raises(ValueError, match="needs a shard that is one block"):
                write_sharded(weight, values[0], index=0)
