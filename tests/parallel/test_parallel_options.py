"""`ParallelOptions`: one validated object for how a layout is applied, accepted whole by `parallelize`.

Oracle for the parallelized model: `parallelize` called with the keyword arguments it has always
taken; the options object (as ``options=`` or in the place of ``dispatcher``) must give the same
local tensors and the same bound dispatcher on every rank.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.dist import run_distributed

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims, ParallelOptions, build_parallel_context, parallelize
from lightning_moe.strategies import MoEStrategy


def _model() -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(MoETransformerConfig(
        vocab_size=32, hidden_size=16, num_layers=2, num_attention_heads=2, ffn_hidden_size=32,
        first_dense_layers=1, moe=MoEConfig(16, 8, 4, top_k=2),
    ))


def _summary(model: MoETransformer) -> dict:
    state = {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in model.state_dict().items()}
    return {"state": state, "dispatcher": type(model.layers[1].ffn.dispatcher).__name__}


def _three_ways(rank: int, world: int) -> list[dict]:
    ctx = build_parallel_context(ParallelDims(world, ep=2), "cpu")
    options = ParallelOptions(dispatcher="allgather", cp_comm_type="all_gather")
    return [
        _summary(parallelize(_model(), ctx, dispatcher="allgather", cp_comm_type="all_gather")),
        _summary(parallelize(_model(), ctx, options=options)),
        _summary(parallelize(_model(), ctx, options)),
    ]


@pytest.mark.distributed
def test_parallelize_takes_the_options_whole_or_as_keywords(tmp_path):
    for rank, (keywords, *others) in enumerate(run_distributed(_three_ways, 2, tmp_dir=tmp_path)):
        assert keywords["dispatcher"] == "AllGatherDispatcher", rank
        for other in others:
            assert other["dispatcher"] == keywords["dispatcher"], rank
            assert other["state"].keys() == keywords["state"].keys()
            for key, value in keywords["state"].items():
                assert torch.equal(other["state"][key], value), f"rank {rank}: {key}"


def test_options_and_keywords_together_are_refused():
    with pytest.raises(TypeError, match="Got a ParallelOptions and also sharding_strategy"):
        parallelize(torch.nn.Linear(2, 2), None, options=ParallelOptions(), sharding_strategy="FULL_SHARD")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dispatcher", "all2all", r"Unknown dispatcher 'all2all'; choose one of \['allgather', 'alltoall', 'flex'\]"),
        ("flex_backend", "nccl", r"Unknown flex_backend 'nccl'"),
        ("sharding_strategy", "ZERO3", r"Unknown sharding_strategy 'ZERO3'"),
        ("cp_comm_type", "ring", r"Unknown cp_comm_type 'ring'; choose one of \['p2p', 'all_gather'\]"),
    ],
)
def test_every_name_is_checked_when_built(field, value, message):
    with pytest.raises(ValueError, match=message):
        ParallelOptions(**{field: value})
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(ParallelOptions(), **{field: value})


def test_the_strategy_builds_the_options_once_from_its_arguments():
    strategy = MoEStrategy(dispatcher="allgather", sharding_strategy="FULL_SHARD", cp_comm_type="all_gather")
    assert strategy.parallel_options == ParallelOptions("allgather", "FULL_SHARD", None, "auto", "all_gather")
    assert (strategy.dispatcher, strategy.sharding_strategy, strategy.cp_comm_type) == (
        "allgather", "FULL_SHARD", "all_gather")
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.parallel_options.dispatcher = "alltoall"
