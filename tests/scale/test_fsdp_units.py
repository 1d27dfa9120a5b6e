"""FSDP2 units of the real presets at scale: one root, and the explicit prefetch order of the blocks.

Mixtral-8x7B (32 MoE blocks) on one fake rank of world 64 (TP=8, EP=8: dense units over DP=8,
experts over EDP=8) and at PP=2 (world 128), built on meta and sharded with ``FULL_SHARD`` as the
strategy does. Oracle: the model's own block order. Each unit of the chain (embedding, blocks,
final norm, head; under PP each stage's own pieces and blocks) is set to prefetch, in forward, the
next unit of the chain and that unit's experts (on the expert mesh), and in backward the previous
one and its experts. Under PP each stage module is the root of its units.

What the CPU cannot show: the overlap the prefetch buys (GPU streams), see
``tests/parallel/test_fully_shard_root.py`` for the order in which the all-gathers are issued on a
real step.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from parallel.test_fully_shard_root import config
from scale.fake_world import sharded_preset
from torch.distributed.fsdp import FSDPModule

from lightning_moe.models import MoETransformer
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize
from lightning_moe.parallel.pipeline.runner import PipelineRunner
from lightning_moe.planning.fake_world import fake_rank
from lightning_moe.strategies.model_setup import shard_split_model

DIMS = ParallelDims(world_size=64, tp=8, ep=8, etp=1)
PP_DIMS = ParallelDims(world_size=128, tp=8, ep=8, etp=1, pp=2)


def _state(module):
    return module._get_fsdp_state()


def _targets(states: list) -> list:
    return [id(s) for s in states]


def _check_chain(chain: list, experts: dict[int, FSDPModule]) -> None:
    """``chain``: the units in forward order; ``experts``: id(block) -> its expert unit. A unit that
    appears twice (a tied embedding and head) prefetches what follows each of its appearances."""
    assert all(isinstance(unit, FSDPModule) for unit in chain)

    def with_experts(unit) -> list:
        return [id(_state(unit))] + ([id(_state(experts[id(unit)]))] if id(unit) in experts else [])

    forward: dict[int, list] = {}
    backward: dict[int, list] = {}
    for i, unit in enumerate(chain):
        forward.setdefault(id(_state(unit)), []).extend(with_experts(chain[i + 1]) if i + 1 < len(chain) else [])
        backward.setdefault(id(_state(unit)), []).extend(with_experts(chain[i - 1]) if i > 0 else [])
    for i, unit in enumerate(chain):
        state = _state(unit)
        assert _targets(state._states_to_forward_prefetch) == forward[id(state)], f"unit {i} of {len(chain)}: forward"
        assert _targets(state._states_to_backward_prefetch) == backward[id(state)], f"unit {i} of {len(chain)}: backward"


def _experts(blocks) -> dict[int, FSDPModule]:
    return {id(block): block.ffn.experts for block in blocks if hasattr(block.ffn, "experts")}


def test_full_shard_blocks_prefetch_their_neighbours_and_their_experts():
    with fake_rank(0, DIMS.world_size):
        sharded = sharded_preset("mixtral_8x7b", DIMS, 0, "FULL_SHARD")
        model = sharded.model
        blocks = list(model.layers)
        experts = _experts(blocks)
        assert len(experts) == sharded.config.num_layers == 32
        _check_chain([model.embed, *blocks, model.norm, model.lm_head], experts)
        expert_mesh = sharded.ctx.expert_mesh["edp"]
        for unit in experts.values():
            assert _state(unit)._fsdp_param_groups[0].mesh_info.mesh == expert_mesh


def test_pipeline_stages_are_the_roots_of_their_units():
    for rank in (0, PP_DIMS.world_size - 1):
        with fake_rank(rank, PP_DIMS.world_size):
            sharded = sharded_preset("mixtral_8x7b", PP_DIMS, rank)
            runner = PipelineRunner(sharded.model, sharded.ctx, "1F1B", 2, lambda out, _: out.sum(), torch.device("cpu"))
            shard_split_model(sharded.model, runner.shard_units(), sharded.ctx, "FULL_SHARD")
            (stage,) = runner.modules
            assert isinstance(stage, FSDPModule), rank
            assert not _state(stage)._fsdp_param_groups  # every piece and block is a unit of its own
            blocks = list(stage.blocks.values())
            assert len(blocks) == 16
            _check_chain([*stage.pieces.values()][: int(stage.is_first)] + blocks
                         + [*stage.pieces.values()][int(stage.is_first):], _experts(blocks))


def test_tied_embedding_and_head_are_one_unit():
    """FSDP2 shards a parameter in one unit only: a tied embedding and head share one unit, which
    stays tied and prefetches the first block in forward and the final norm in backward."""
    # World 8, not the 2 or 4 of the forked gloo tests: at world 4, a forked test run later in the
    # same session failed resolving a process group of this fake world (state torch keeps after the
    # fake group is destroyed, reached through an equal mesh).
    dims = ParallelDims(world_size=8, ep=2, etp=1)
    with fake_rank(1, dims.world_size):
        with torch.device("meta"):
            model = MoETransformer(replace(config(), tie_embeddings=True))
        parallelize(model, build_parallel_context(dims, "cpu"), sharding_strategy="FULL_SHARD")
        assert model.embed.weight is model.lm_head.weight
        assert _state(model.embed) is _state(model.lm_head)
        blocks = list(model.layers)
        _check_chain([model.embed, *blocks, model.norm, model.lm_head], _experts(blocks))
