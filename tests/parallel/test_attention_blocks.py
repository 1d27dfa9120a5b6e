"""The ring's block kernels equal PyTorch's attention on one block: output, log-sum-exp and gradients.

Oracle: ``scaled_dot_product_attention`` (math) and ``logsumexp`` of the scores, with autograd
for the gradients. A kernel's backward is given the oracle's own output and log-sum-exp, as the
ring gives it the merged ones. Shapes: a causal square block (a rank's own chunks) and an unmasked
rectangular one (queries over earlier keys), with a value width below the key's (MLA).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.parallel.context_parallel.blocks import (
    CpuFlashBlock,
    MathBlock,
    select_block_kernel,
)

SCALE = 0.37


def _block(dtype: torch.dtype, seq_q: int, seq_k: int, dv: int):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, seq_q, 8, generator=g).to(dtype)
    k = torch.randn(2, 3, seq_k, 8, generator=g).to(dtype)
    v = torch.randn(2, 3, seq_k, dv, generator=g).to(dtype)
    dout = torch.randn(2, 3, seq_q, dv, generator=g).to(dtype)
    return q, k, v, dout


def _oracle(q, k, v, dout, causal: bool):
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*inputs, is_causal=causal, scale=SCALE)
    scores = inputs[0] @ inputs[1].transpose(-1, -2) * SCALE
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    out.backward(dout.double())
    return out.detach(), torch.logsumexp(scores, -1).detach(), *(t.grad for t in inputs)


@pytest.mark.parametrize("kernel", [MathBlock, CpuFlashBlock])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(("seq_q", "seq_k", "causal"), [(8, 8, True), (4, 8, False)])
@pytest.mark.parametrize("dv", [8, 6])
def test_block_kernel_equals_attention(kernel, dtype, tolerance, seq_q, seq_k, causal, dv):
    q, k, v, dout = _block(dtype, seq_q, seq_k, dv)
    out_ref, lse_ref, dq_ref, dk_ref, dv_ref = _oracle(q, k, v, dout, causal)
    out, lse, saved = kernel.forward(q, k, v, causal, SCALE)
    assert out.shape == out_ref.shape and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), out_ref, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-2)
    grads = kernel.backward(dout, q, k, v, out_ref.to(dtype), lse_ref.float(), saved, causal, SCALE)
    for name, got, want, like in zip("qkv", grads, (dq_ref, dk_ref, dv_ref), (q, k, v)):
        assert got.shape == like.shape, name
        torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance, msg=lambda m, n=name: f"d{n}: {m}")


def test_cpu_tensors_get_the_fused_kernel_where_it_applies():
    q, _, v, _ = _block(torch.float32, 4, 4, 6)
    assert select_block_kernel(q, v) is CpuFlashBlock
    assert select_block_kernel(q.bfloat16(), v.bfloat16()) is CpuFlashBlock
    assert select_block_kernel(q.double(), v.double()) is MathBlock  # the fused kernels take no fp64
    assert select_block_kernel(q, torch.zeros(2, 3, 4, 12)) is MathBlock  # v wider than q: no padding
    assert select_block_kernel(q, v, "math") is MathBlock
    with pytest.raises(ValueError, match="Unknown attention block kernel 'flash3'"):
        select_block_kernel(q, v, "flash3")


@pytest.mark.parametrize("kernel", [MathBlock, CpuFlashBlock])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_masked_block_equals_attention_and_empty_rows_weigh_nothing(kernel, dtype, tolerance):
    # A block partly inside a sliding window: some rows see a few keys, the first row none at all.
    q, k, v, dout = _block(dtype, 4, 8, 6)
    mask = torch.tensor([[False] * 8, [True] + [False] * 7, [True] * 3 + [False] * 5, [False, True, True] + [False] * 5])
    out, lse, saved = kernel.forward(q, k, v, False, SCALE, mask)
    assert torch.equal(out[:, :, 0].float(), torch.zeros_like(out[:, :, 0].float()))
    assert torch.isneginf(lse[:, :, 0]).all()
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    scores = (inputs[0] @ inputs[1].transpose(-1, -2) * SCALE).masked_fill(~mask, float("-inf"))
    rows = slice(1, None)  # the oracle on the rows that see something
    out_ref = scores[:, :, rows].softmax(-1) @ inputs[2]
    out_ref.backward(dout[:, :, rows].double())
    lse_ref = torch.logsumexp(scores[:, :, rows], -1)
    torch.testing.assert_close(out[:, :, rows].double(), out_ref.detach(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(lse[:, :, rows].double(), lse_ref.detach(), rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-2)
    # Backward with the merged lse of a whole row (another block gave the empty row its keys): here
    # the empty row's lse is made finite and its gradient through this block must be zero.
    merged_lse = lse.float().clone()
    merged_lse[:, :, 0] = 0.0
    merged_out = out.clone()
    grads = kernel.backward(dout.masked_fill(torch.arange(4)[:, None] == 0, 0.0), q, k, v, merged_out, merged_lse,
                            saved, False, SCALE, mask)
    for name, got, want in zip("qkv", grads, (t.grad for t in inputs)):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance, msg=lambda m, n=name: f"d{n}: {m}")
