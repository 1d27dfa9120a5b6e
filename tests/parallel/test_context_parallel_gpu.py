"""Context-parallel attention on one GPU over NCCL (``benchmarks/gpu_check.sh`` runs it).

A CP group of one still runs the chunked path (positions, masks, the fp32 merge); it must equal
CUDA's causal ``scaled_dot_product_attention`` in outputs and gradients, in bf16 inputs too. The
multi-rank exchanges are tested on gloo by ``test_context_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_moe.parallel.context_parallel import context_parallel_attention

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl_group():
    """A one-rank NCCL group in this process (forked ranks cannot use CUDA once the parent did)."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist.new_group([0])
    if created:
        dist.destroy_process_group()


def _compare(group, comm_type: str, dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 16, device="cuda", generator=g, dtype=dtype) for _ in range(3))
    grad = torch.randn(2, 4, 64, 16, device="cuda", generator=g, dtype=dtype)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    ref.backward(grad)
    cp_in = [t.clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*cp_in, group, cp_comm_type=comm_type)
    out.backward(grad)
    errors = {"out": (out.float() - ref.float()).abs().max().item()}
    for name, a, b in zip("qkv", cp_in, ref_in):
        errors[name] = (a.grad.float() - b.grad.float()).abs().max().item()
    return errors


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_one_rank_context_parallel_attention_equals_cuda_sdpa(comm_type, dtype_name, nccl_group):
    errors = _compare(nccl_group, comm_type, dtype_name)
    tolerance = 2e-5 if dtype_name == "float32" else 3e-2  # bf16: SDPA rounds inside, ours in fp32
    assert all(err <= tolerance for err in errors.values()), errors
