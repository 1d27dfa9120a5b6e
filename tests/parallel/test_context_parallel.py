"""Context-parallel causal attention equals full-sequence attention on one device, outputs and gradients.

Oracle: ``scaled_dot_product_attention(is_causal=True)`` on the whole sequence in one process. Each
CP rank holds chunks ``r`` and ``2C-1-r`` of every sequence; its output and the gradients of its
q/k/v shards must equal the matching rows of the oracle's, for both exchanges (ring and
all-gather), with grouped-query attention and a value width other than the key's (as in MLA).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.dist import run_distributed

from lightning_moe.memory import SavedTensorCounter
from lightning_moe.parallel.context_parallel import (
    context_parallel_attention,
    load_balanced_positions,
    shard_sequence,
    unshard_sequence,
)

pytestmark = pytest.mark.distributed

B, H, H_KV, S, D, DV = 2, 4, 2, 16, 8, 6


def _inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=g)
    k = torch.randn(B, H_KV, S, D, generator=g)
    v = torch.randn(B, H_KV, S, DV, generator=g)
    grad = torch.randn(B, H, S, DV, generator=g)
    return q, k, v, grad


def _oracle():
    q, k, v, grad = (t.requires_grad_() if i < 3 else t for i, t in enumerate(_inputs()))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _run(rank: int, world: int, comm_type: str, kernel: str = "auto", dtype: torch.dtype = torch.float32) -> dict:
    group = dist.group.WORLD
    q, k, v, grad = (shard_sequence(t, rank, world, dim=2).to(dtype) for t in _inputs())
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    # Under CPU autocast as in a bf16-mixed model (the ring must not let autocast recast its fp32 merge).
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = context_parallel_attention(q, k, v, group, cp_comm_type=comm_type, block_kernel=kernel)
    out.backward(grad)
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


# p2p with "auto" runs PyTorch's fused CPU kernels in each ring step (v zero-padded to the key
# width, D=8, Dv=6); "math" runs the fp32-matmul kernel that CUDA falls back to in fp32.
@pytest.mark.parametrize(("comm_type", "kernel"), [("p2p", "auto"), ("p2p", "math"), ("all_gather", "auto")])
@pytest.mark.parametrize("world", [1, 2, 4])  # 1: a CP group of one still runs the chunked path
def test_context_parallel_attention_equals_full_attention(world, comm_type, kernel, tmp_path):
    ranks = run_distributed(_run, world, comm_type, kernel, tmp_dir=tmp_path)
    want = dict(zip(("out", "q", "k", "v"), _oracle()))
    for name, value in want.items():
        got = unshard_sequence([r[name] for r in ranks], dim=2)
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_bf16_context_parallel_attention_keeps_bf16_and_matches_fp32_attention(comm_type, tmp_path):
    ranks = run_distributed(_run, 4, comm_type, "auto", torch.bfloat16, tmp_dir=tmp_path)
    want = dict(zip(("out", "q", "k", "v"), _oracle()))
    for name, value in want.items():
        pieces = [r[name] for r in ranks]
        assert all(p.dtype == torch.bfloat16 for p in pieces), (name, [p.dtype for p in pieces])
        got = unshard_sequence(pieces, dim=2).float()
        # bf16 inputs (8 bits of mantissa) against the fp32 oracle on the unrounded inputs.
        torch.testing.assert_close(got, value, rtol=5e-2, atol=5e-2, msg=lambda m, n=name: f"{n}: {m}")


def _saved_bytes(rank: int, world: int) -> tuple[int, int]:
    q, k, v, _ = (shard_sequence(t, rank, world, dim=2).requires_grad_() for t in _inputs())
    counter = SavedTensorCounter()
    with counter:
        out = context_parallel_attention(q, k, v, dist.group.WORLD, cp_comm_type="p2p")
    saved = sum(counter.saved_bytes().values())
    lse_bytes = out.numel() // out.shape[-1] * 4  # one fp32 log-sum-exp per query row
    return saved, sum(t.nbytes for t in (q, k, v, out)) + lse_bytes


def test_ring_saves_only_its_inputs_output_and_log_sum_exp(tmp_path):
    # Memory: no per-step scores or probabilities survive the forward (O(S_local), not O(S_local x S)).
    for saved, expected in run_distributed(_saved_bytes, 2, tmp_dir=tmp_path):
        assert saved == expected, (saved, expected)


def test_load_balanced_chunks_cover_the_sequence_once_with_equal_causal_work():
    cp = 4
    positions = [load_balanced_positions(S, r, cp) for r in range(cp)]
    assert sorted(torch.cat(positions).tolist()) == list(range(S))
    work = [int((p + 1).sum()) for p in positions]  # keys visible to each rank's queries
    assert len(set(work)) == 1, work
    x = torch.arange(S).expand(B, S)
    assert torch.equal(unshard_sequence([shard_sequence(x, r, cp) for r in range(cp)]), x)


def test_sequence_length_must_split_into_two_chunks_per_rank():
    with pytest.raises(ValueError, match="2 x CP = 8 equal chunks, but the sequence length 12"):
        load_balanced_positions(12, 0, 4)


def test_unknown_comm_type_is_refused():
    with pytest.raises(ValueError, match="Unknown cp_comm_type 'ring'"):
        context_parallel_attention(*_inputs()[:3], group=None, cp_comm_type="ring")
