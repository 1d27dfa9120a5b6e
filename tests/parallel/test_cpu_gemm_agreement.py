"""Every rank of a job computes its CPU expert GEMMs with the library rank 0 chose.

Each process measures ATen against oneDNN for itself; two ranks can then disagree (other load,
other thread counts) and their results differ in the last bits. The measurement is replaced here
by one that answers differently per rank, so without agreement the ranks would disagree.
"""

from __future__ import annotations

import pytest
import torch
from helpers.dist import run_distributed

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.layers import cpu_gemm
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize
from lightning_moe.parallel.cpu_gemm_agreement import agree_on_cpu_gemm, describe_cpu_gemm_choices

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="this torch build has no usable oneDNN fp32 linear"),
]


def _agree(rank: int, world: int, agree: bool) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(MoELayer(MoEConfig(32, 16, 4, top_k=2)), MoELayer(MoEConfig(32, 8, 4, top_k=2)))
    parallelize(model, build_parallel_context(ParallelDims(world, ep=world), "cpu"))
    cpu_gemm._measured_choice = lambda i, o: "onednn" if rank == 0 else "aten"  # a per-rank measurement
    with cpu_gemm.use_cpu_gemm_backend("auto"):
        choices = agree_on_cpu_gemm(model) if agree else {}
        used = [cpu_gemm.gemm_for(torch.device("cpu"), torch.float32, 32, rows).name for rows in (32, 16)]
    cpu_gemm.pin_cpu_gemm_choices(None)
    return {"choices": choices, "used": used}


@pytest.mark.parametrize("agree", [True, False], ids=["agreed", "each-rank-measures"])
def test_ranks_use_rank_zero_choice(tmp_path, agree):
    ranks = run_distributed(_agree, 2, agree, tmp_dir=tmp_path)
    if not agree:  # the condition being fixed: left alone, the ranks disagree
        assert [r["used"] for r in ranks] == [["onednn"] * 2, ["aten"] * 2]
        return
    for r in ranks:
        assert r["choices"] == {(32, 32): "onednn", (32, 16): "onednn"}
        assert r["used"] == ["onednn", "onednn"]


def test_description_groups_shapes_by_library():
    text = describe_cpu_gemm_choices({(32, 16): "aten", (32, 64): "onednn", (8, 4): "aten"})
    assert text == "aten for fc1 [4, 8], [16, 32]; onednn for fc1 [64, 32]"
