"""Context-parallel attention with a sliding window and attention sinks (GPT-OSS) equals one process.

Oracle: eager attention on the whole sequence written here, as ``transformers``' GPT-OSS computes
it: scores ``q k^T * scale``, the window mask (query ``i`` sees keys ``i - W < j <= i``), a column of
per-head sink logits appended, softmax, the sink column dropped, times ``v``; gradients by autograd,
in float64. Each CP rank's output and q/k/v gradients must equal its rows of the oracle's, and the
ranks' sink gradients must sum to the oracle's (each rank's queries own a share), with windows
shorter and longer than a CP chunk. The ring must skip the blocks wholly outside the window:
the kernel calls are counted and checked against the chunk pairs whose positions meet in the window.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed
from torch import Tensor

from lightning_moe.parallel.context_parallel import blocks as attention_blocks
from lightning_moe.parallel.context_parallel import (
    context_parallel_attention,
    load_balanced_positions,
    shard_sequence,
    unshard_sequence,
)

pytestmark = pytest.mark.distributed

B, H, H_KV, S, D, DV = 2, 4, 2, 16, 8, 6
SCALE = D**-0.5


def _inputs():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, S, D, generator=g)
    k = torch.randn(B, H_KV, S, D, generator=g)
    v = torch.randn(B, H_KV, S, DV, generator=g)
    sinks = torch.randn(H, generator=g)
    grad = torch.randn(B, H, S, DV, generator=g)
    return q, k, v, sinks, grad


def eager_attention(q, k, v, sinks, window, q_positions=None, k_positions=None):
    """GPT-OSS's eager attention: softmax over [scores, sink] with the sink column dropped."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    q_pos = torch.arange(q.shape[2]) if q_positions is None else q_positions
    k_pos = torch.arange(k.shape[2]) if k_positions is None else k_positions
    i, j = q_pos[:, None], k_pos[None, :]
    visible = j <= i
    if window is not None:
        visible = visible & (j > i - window)
    scores = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~visible, float("-inf"))
    if sinks is not None:
        column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
        probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return probs @ v


def _oracle(window):
    q, k, v, sinks, grad = _inputs()
    inputs = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    out = eager_attention(*inputs, window)
    out.backward(grad.double())
    return out.detach(), *(t.grad for t in inputs)


def _run(rank: int, world: int, comm_type: str, kernel: str, window: int) -> dict:
    q, k, v, sinks, grad = _inputs()
    q, k, v, grad = (shard_sequence(t, rank, world, dim=2) for t in (q, k, v, grad))
    q, k, v, sinks = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    out = context_parallel_attention(
        q, k, v, dist.group.WORLD, cp_comm_type=comm_type, block_kernel=kernel, sinks=sinks, window=window
    )
    out.backward(grad)
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad, "sinks": sinks.grad}


CASES = [
    # (world, window): CP2 chunks hold 4 tokens, CP4 chunks 2; windows shorter and longer than a chunk.
    (2, 1), (2, 3), (2, 6), (2, 11),
    (4, 1), (4, 3), (4, 5), (4, 11),
]


@pytest.mark.parametrize(("comm_type", "kernel"), [("p2p", "auto"), ("p2p", "math"), ("all_gather", "auto")])
@pytest.mark.parametrize(("world", "window"), CASES)
def test_context_parallel_window_and_sinks_equal_one_process(world, window, comm_type, kernel, tmp_path):
    ranks = run_distributed(_run, world, comm_type, kernel, window, tmp_dir=tmp_path)
    want = dict(zip(("out", "q", "k", "v", "sinks"), _oracle(window)))
    for name in ("out", "q", "k", "v"):
        got = unshard_sequence([r[name] for r in ranks], dim=2)
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got.double(), want[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    got_sinks = torch.stack([r["sinks"] for r in ranks]).sum(0)
    torch.testing.assert_close(got_sinks.double(), want["sinks"], rtol=1e-5, atol=1e-5)


def test_the_window_changes_the_result():
    # Guards the cases above against a window that masks nothing.
    q, k, v, sinks, _ = _inputs()
    assert not torch.allclose(eager_attention(q, k, v, sinks, 3), eager_attention(q, k, v, sinks, None))


def _positions_of(rows: Tensor, full: Tensor) -> list[int]:
    """Global positions of ``rows`` ``[n, D]``: the rows of ``full`` ``[S, D]`` they equal (random rows differ)."""
    return [int((full - row).abs().sum(-1).argmin()) for row in rows]


def _record_kernel_calls(rank: int, world: int, window: int) -> list[tuple[list[int], list[int]]]:
    """(query positions, key positions) of every block-kernel call of this rank's ring forward."""
    q_full, k_full, v_full, sinks, _ = _inputs()
    calls: list[tuple[list[int], list[int]]] = []
    original = attention_blocks.MathBlock.forward.__func__

    def recording(cls, q, k, v, causal, scale, mask=None):
        # Head 0 of sample 0; the ring repeats kv head 0 for query heads 0 and 1.
        calls.append((_positions_of(q[0, 0], q_full[0, 0]), _positions_of(k[0, 0], k_full[0, 0])))
        return original(cls, q, k, v, causal, scale, mask)

    attention_blocks.MathBlock.forward = classmethod(recording)
    try:
        q, k, v = (shard_sequence(t, rank, world, dim=2) for t in (q_full, k_full, v_full))
        context_parallel_attention(q, k, v, dist.group.WORLD, block_kernel="math", sinks=sinks, window=window)
    finally:
        attention_blocks.MathBlock.forward = classmethod(original)
    return calls


@pytest.mark.parametrize(("world", "window"), [(4, 1), (4, 3), (2, 3), (2, 6)])
def test_ring_skips_blocks_wholly_outside_the_window(world, window, tmp_path):
    """Every chunk pair in the window is computed exactly once, none wholly outside it at all (the
    causal square of a rank's own chunks may carry its upper corner, which causality hides)."""
    ranks = run_distributed(_record_kernel_calls, world, window, tmp_dir=tmp_path)
    chunk = S // (2 * world)
    skipped = 0
    for rank, calls in enumerate(ranks):
        mine = load_balanced_positions(S, rank, world)
        in_window = {  # (query chunk, key chunk) pairs where some query sees some key
            (a, b) for a in {int(p) // chunk for p in mine} for b in range(2 * world)
            if any(b * chunk + j <= a * chunk + i and b * chunk + j > a * chunk + i - window
                   for i in range(chunk) for j in range(chunk))
        }
        computed: list[tuple[int, int]] = []
        for q_pos, k_pos in calls:
            pairs = {(qp // chunk, kp // chunk) for qp in q_pos for kp in k_pos}
            wasted = {(a, b) for a, b in pairs if (a, b) not in in_window and b <= a}
            assert not wasted, f"rank {rank} computed chunk pairs wholly outside the window: {sorted(wasted)}"
            computed += [p for p in pairs if p in in_window]
        assert sorted(computed) == sorted(in_window), (rank, sorted(computed), sorted(in_window))
        skipped += sum(1 for a in {int(p) // chunk for p in mine} for b in range(a + 1) if (a, b) not in in_window)
    assert window >= S or skipped, "the window should leave some chunk pairs out, or this test shows nothing"
