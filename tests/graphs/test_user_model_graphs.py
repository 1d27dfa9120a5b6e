"""`CUDAGraphCapture` on a user's own model (``memory/user_model.py``): no reference ``TransformerBlock``.

The model has its own attention module, ``torch.nn.LayerNorm`` s and two bare ``lightning_moe.MoELayer`` s.
At the callback's defaults (``attn`` + ``moe_router``) the ``attn`` scope finds nothing: it warns
once, naming the scope and what it looks for, and is skipped; ``moe_router`` is kept (the bare
MoE layers take it). On CPU the callback then warns once that it does nothing, and training runs
exactly like the run without it. ``strict=True`` raises instead of skipping. ``emulate=True`` (the
CPU proxy of the GPU path) replays the kept scope on both MoE layers and trains like eager mode;
the ``gpu`` test does the same with real graphs.
"""

from __future__ import annotations

import pytest
import torch
from memory.user_model import fit_user

from lightning_moe.callbacks.cuda_graphs import CUDAGraphCapture

# The emulated replay re-runs the same ops; the replayed backward sums the aux-loss gradients
# through torch.autograd.grad instead of the engine's accumulation: a few fp32 ulps.
REPLAY_TOL = 1e-6
ATTN_SKIPPED = (
    "CUDAGraphCapture: scope 'attn' found nothing to capture in UserLM: it captures the attention_residual of "
    "the blocks a model declares in parallel_plan().graph_blocks"
)


def count(messages: list[str], text: str) -> int:
    return sum(text in message for message in messages)


def test_defaults_skip_attn_with_a_warning_and_train_eagerly_on_cpu():
    eager, _ = fit_user([])
    callback = CUDAGraphCapture()
    got, messages = fit_user([callback])
    assert count(messages, ATTN_SKIPPED) == 1, messages
    (skipped,) = [m for m in messages if ATTN_SKIPPED in m]
    assert "skipped; kept scopes: ['moe_router']" in skipped, skipped
    assert count(messages, "CUDAGraphCapture(scopes=['moe_router']) does nothing on cpu") == 1, messages
    torch.testing.assert_close(got.losses, eager.losses, rtol=0, atol=0)
    assert callback.stats() == {}
    # Warned once per callback: a second fit with the same callback says nothing again.
    _, messages = fit_user([callback])
    assert count(messages, "CUDAGraphCapture") == 0, messages


def test_scopes_that_all_find_nothing_leave_the_model_eager():
    callback = CUDAGraphCapture(scopes=["attn"])
    _, messages = fit_user([callback])
    (skipped,) = [m for m in messages if ATTN_SKIPPED in m]
    assert "skipped; no scope is left, the model runs eagerly" in skipped, skipped
    assert count(messages, "does nothing on cpu") == 0, messages  # one warning says it all


def test_strict_raises_for_a_scope_that_finds_nothing():
    with pytest.raises(ValueError, match=r"scope 'attn' found nothing to capture in UserLM.*strict=True"):
        fit_user([CUDAGraphCapture(strict=True)])


def test_missing_scopes_names_what_each_looks_for():
    from memory.user_model import UserModel

    from lightning_moe.graphs import missing_scopes
    from lightning_moe.models import MoETransformer, MoETransformerConfig

    missing = missing_scopes(UserModel(), ["attn", "moe_router"])
    assert list(missing) == ["attn"] and "TransformerBlock" in missing["attn"]
    dense = MoETransformer(MoETransformerConfig(vocab_size=16, hidden_size=16, num_layers=1, num_attention_heads=2,
                                                ffn_hidden_size=32))
    assert list(missing_scopes(dense, ["attn", "moe_router", "moe_preprocess"])) == ["moe_router", "moe_preprocess"]


def test_emulated_defaults_replay_the_moe_router_of_both_moe_layers():
    eager, _ = fit_user([], steps=5)
    callback = CUDAGraphCapture(warmup_steps=2, emulate=True)
    got, messages = fit_user([callback], steps=5)
    assert count(messages, ATTN_SKIPPED) == 1, messages
    assert count(messages, "running eagerly") == 0, messages  # no eager fallback
    torch.testing.assert_close(got.losses, eager.losses, rtol=REPLAY_TOL, atol=REPLAY_TOL)
    stats = callback.stats()
    assert sorted(stats) == ["net.blocks.0.moe.moe_router", "net.blocks.1.moe.moe_router"], stats
    assert all(s["replays"] == 5 - 2 and s["eager_fallbacks"] == 0 for s in stats.values()), stats


@pytest.mark.gpu
def test_gpu_defaults_capture_the_moe_router_of_a_user_model_and_train_like_eager():
    eager, _ = fit_user([], steps=6, accelerator="gpu")
    callback = CUDAGraphCapture(warmup_steps=3)
    got, messages = fit_user([callback], steps=6, accelerator="gpu")
    assert count(messages, ATTN_SKIPPED) == 1, messages
    assert count(messages, "does nothing") == 0 and count(messages, "running eagerly") == 0, messages
    stats = callback.stats()
    assert sorted(stats) == ["net.blocks.0.moe.moe_router", "net.blocks.1.moe.moe_router"], stats
    assert all(s["replays"] == 6 - 3 for s in stats.values()), stats
    # fp32 on the GPU: the graphs run the same kernels; the aux-loss gradient sum may differ in order.
    torch.testing.assert_close(torch.stack(got.losses), torch.stack(eager.losses), rtol=1e-5, atol=1e-5)
