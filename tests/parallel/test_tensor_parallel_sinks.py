"""Tensor parallelism of GPT-OSS's attention: head-sharded sinks, the row-parallel o_proj's bias, windows.

Oracle: the single-device model on the global batch (``_train_and_compare`` of the tensor-parallel
tests): losses, every gradient (the sinks' and the bias's included) and the weights after a few
AdamW steps. The sinks are sharded with the query heads; the o_proj bias must be added once, to the
reduced output, not once per TP rank.
"""

from __future__ import annotations

import pytest
import torch
from helpers.asserts import exceeds
from helpers.dist import run_distributed
from parallel.test_tensor_parallel import GRAD_TOL, LOSS_TOL, WEIGHT_TOL, _train_and_compare
from torch.distributed.tensor import DTensor, Shard

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize

pytestmark = pytest.mark.distributed


def _config() -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2,
        ffn_hidden_size=64, first_dense_layers=1, init_std=0.2,
        attention_out_bias=True, attention_sinks=True, sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
        moe=MoEConfig(32, 16, 8, top_k=2),
    )


@pytest.mark.parametrize("layout", ["tp2", "tp2-ep2-folded"])
def test_tensor_parallel_sinks_and_out_bias_equal_single_device(layout, tmp_path):
    world, sizes = {"tp2": (2, {"tp": 2}), "tp2-ep2-folded": (2, {"tp": 2, "etp": 1, "ep": 2})}[layout]
    results = run_distributed(_train_and_compare, world, sizes, None, _config(), timeout_s=180, tmp_dir=tmp_path)
    failures = {
        f"rank {rank}: {key}": err for rank, worst in enumerate(results) for key, err in worst.items()
        if exceeds(err, LOSS_TOL if key == "loss" else GRAD_TOL if key.startswith("grad") else WEIGHT_TOL)
    }
    assert not failures, failures
    keys = set(results[0])
    assert {"grad layers.0.attn.sinks", "grad layers.0.attn.o_proj.bias"} <= keys, sorted(keys)


def _placements(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = MoETransformer(_config())
    parallelize(model, build_parallel_context(ParallelDims(world, tp=2), "cpu"))
    sinks = model.layers[0].attn.sinks
    return {"sinks": (type(sinks.data).__name__, tuple(sinks.placements), tuple(sinks.to_local().shape))}


def test_sinks_are_sharded_with_the_query_heads(tmp_path):
    for result in run_distributed(_placements, 2, tmp_dir=tmp_path):
        assert result["sinks"] == (DTensor.__name__, (Shard(0),), (2,)), result
