"""Context-parallel attention on one GPU over NCCL (``benchmarks/gpu_check.sh`` runs it).

A CP group of one still runs the chunked path (the ring's block kernel and its fp32 merge, the
all-gather's masked SDPA); it must equal CUDA's causal ``scaled_dot_product_attention`` in outputs
and gradients, in bf16 inputs too. In bf16 the ring must run CUDA's flash-attention kernels (its
fused path), also with a value width below the key's (MLA, v zero-padded); in fp32 it falls back to
fp32 matmuls. The multi-rank exchanges are tested on gloo by ``test_context_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_moe.parallel.context_parallel import context_parallel_attention
from lightning_moe.parallel.context_parallel.blocks import CudaFlashBlock, MathBlock, select_block_kernel

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


def _compare(group, comm_type: str, dtype_name: str, head_dim: int = 16, v_dim: int = 16) -> dict:
    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(2, 4, 64, head_dim, device="cuda", generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(2, 4, 64, v_dim, device="cuda", generator=g, dtype=dtype)
    grad = torch.randn(2, 4, 64, v_dim, device="cuda", generator=g, dtype=dtype)
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


@pytest.mark.parametrize(("dtype_name", "kernel"), [("bfloat16", CudaFlashBlock), ("float32", MathBlock)])
def test_ring_uses_cuda_flash_attention_in_bf16(dtype_name, kernel):
    q = torch.zeros(1, 2, 8, 192, device="cuda", dtype=getattr(torch, dtype_name))
    assert select_block_kernel(q, q[..., :128]) is kernel


def test_mla_shaped_ring_attention_in_bf16_equals_cuda_sdpa(nccl_group):
    errors = _compare(nccl_group, "p2p", "bfloat16", head_dim=48, v_dim=32)
    assert all(err <= 3e-2 for err in errors.values()), errors
