"""torch's default AdamW on CUDA (foreach kernels) over a tensor-parallel model's mixed parameter groups.

At TP=2 the tensor-parallel weights are DTensors while the expert shards, the router and the
shared expert stay plain tensors. On CUDA torch's optimizers default to their foreach kernels,
which DTensor refuses for mixed lists; :func:`~lightning_moe.parallel.allow_mixed_tensors` lets
the update through. One process plays rank 0 of 2 on the fake backend (its collectives return at
once and compute nothing), so values and gradients are set
directly and only this rank's optimizer arithmetic is checked. Oracle: the same steps with ``foreach=False``.
The CPU counterpart, through ``MoEStrategy`` on two gloo ranks, is
tests/strategies/test_optimizer_kernels.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_moe import MoEConfig
from lightning_moe.lit.optimization import optimizer_param_groups
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims, allow_mixed_tensors, build_parallel_context, parallelize

pytestmark = pytest.mark.gpu

TOL = 1e-6  # fp32 AdamW, two steps: the foreach and fused kernels order their operations their own way


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _steps(kernel: str) -> dict[str, torch.Tensor]:
    config = MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        first_dense_layers=1, max_seq_len=8, moe=MoEConfig(32, 16, 4, top_k=2, shared_expert_ffn_hidden_size=16),
    )
    model = MoETransformer(config).cuda()
    parallelize(model, build_parallel_context(ParallelDims(2, tp=2, ep=2, etp=1), "cuda"), dispatcher="allgather")
    kinds = {isinstance(p, DTensor) for p in model.parameters()}
    assert kinds == {True, False}, "the layout no longer mixes DTensors and plain tensors: pick one that does"
    # The fake backend's collectives compute nothing: values and gradients are set here, so that only
    # the optimizer's arithmetic on this rank's tensors is compared.
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            _local(p).copy_(torch.randn(_local(p).shape, generator=generator, device="cuda"))
    options = {"default": {}, "fused": {"fused": True}, "loop": {"foreach": False}}[kernel]
    optimizer = torch.optim.AdamW(optimizer_param_groups(model, 0.1), lr=1e-2, **options)
    for _ in range(2):
        for p in model.parameters():
            grad = torch.randn(_local(p).shape, generator=generator, device="cuda")
            p.grad = DTensor.from_local(grad, p.device_mesh, p.placements) if isinstance(p, DTensor) else grad
        with allow_mixed_tensors():
            optimizer.step()
    return {n: _local(p).detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kernel", ["default", "fused"])
def test_cuda_adamw_kernels_step_over_mixed_groups(kernel):
    """torch's default (foreach) and the fused kernel, which MoELanguageModel picks on CUDA."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        got, loop = _steps(kernel), _steps("loop")
    finally:
        dist.destroy_process_group()
    for name, value in got.items():
        torch.testing.assert_close(value, loop[name], rtol=TOL, atol=TOL, msg=name)
