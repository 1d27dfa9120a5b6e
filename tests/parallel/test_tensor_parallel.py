"""Tensor + sequence parallelism of the reference model, folded with expert parallelism.

Oracle: the single-device model on the global batch. Each data-parallel replica takes its own
samples; the TP ranks of a replica share them and split every sequence. Forward losses, every
gradient after :class:`GradSync` and the weights after a few AdamW steps must equal the
single-device run (fp32, load-balancing losses off).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from helpers.asserts import exceeds, worst_error
from helpers.dist import run_distributed
from models.test_presets import PRESETS, load_preset
from parallel.parity import note_gradients, note_weights, step_and_zero

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize
from lightning_moe.parallel.grad_norm import clip_grad_norm_
from lightning_moe.parallel.grad_sync import GradSync

pytestmark = pytest.mark.distributed

# fp32 through a few reductions in a different order than one device.
LOSS_TOL = 1e-5
GRAD_TOL = 1e-5
WEIGHT_TOL = 1e-5
ADAM_EPS = 1e-2
SAMPLES_PER_REPLICA = 2
SEQ = 8  # divisible by TP
STEPS = 3

LAYOUTS = {
    "tp2": (2, {"tp": 2}),
    "tp2-ep2-folded": (2, {"tp": 2, "etp": 1, "ep": 2}),
    "tp2-etp1-ep4-folded": (4, {"tp": 2, "etp": 1, "ep": 4}),
}


def _config() -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2,
        ffn_hidden_size=64, first_dense_layers=1, qk_norm=True,
        moe=MoEConfig(32, 16, 8, top_k=2, shared_expert_ffn_hidden_size=16, shared_expert_gate=True),
    )


def _train_and_compare(
    rank: int, world: int, layout: dict, clip: float | None, config: MoETransformerConfig | None = None
) -> dict[str, float]:
    torch.manual_seed(0)
    reference = MoETransformer(config or _config())
    model = copy.deepcopy(reference)
    ctx = build_parallel_context(ParallelDims(world, **layout), "cpu")
    parallelize(model, ctx)
    sync = GradSync(model, ctx, bucket_size_mb=0.01)  # several buckets
    # AdamW's step is lr * m / (sqrt(v) + eps): with the default eps=1e-8 an entry whose gradient is
    # ~1e-8 moves by up to lr on a rounding difference of its gradient (its sign decides), so the
    # weights would compare the reduction order, not the layout. eps=1e-2 bounds that gain to lr/eps = 1.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=ADAM_EPS)
    dp, dp_rank = ctx.size("dp"), ctx.rank_in("dp")
    worst: dict[str, float] = {}

    def note(key: str, err: float) -> None:
        worst[key] = worst_error(worst.get(key, 0.0), err)

    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, reference.config.vocab_size, (SAMPLES_PER_REPLICA * dp, SEQ + 1), generator=gen)
        mine = tokens[dp_rank * SAMPLES_PER_REPLICA : (dp_rank + 1) * SAMPLES_PER_REPLICA]
        loss = model.loss(mine[:, :-1], mine[:, 1:])
        loss.backward()
        sync.finish()
        ref_loss = reference.loss(tokens[:, :-1], tokens[:, 1:])
        ref_loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        note("loss", abs(mean_loss.item() / world - ref_loss.item()))
        note_gradients(note, model, reference)
        if clip is not None:
            norm = clip_grad_norm_(model.parameters(), clip, ctx)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            note("grad norm", abs(norm.item() - ref_norm.item()))
        step_and_zero(optimizer, ref_optimizer)
    note_weights(note, model, reference)
    return worst


@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tensor_parallel_training_equals_single_device(layout, clip, tmp_path):
    world, sizes = LAYOUTS[layout]
    results = run_distributed(_train_and_compare, world, sizes, clip, timeout_s=180, tmp_dir=tmp_path)
    failures = {
        f"rank {rank}: {key}": err
        for rank, worst in enumerate(results)
        for key, err in worst.items()
        if exceeds(err, {"loss": LOSS_TOL, "grad norm": GRAD_TOL}.get(key, GRAD_TOL if key.startswith("grad") else WEIGHT_TOL))
    }
    assert not failures, failures


def shrink(config: MoETransformerConfig) -> MoETransformerConfig:
    """A preset at toy size with its structure kept: dense or no dense FFN, GQA or MHA, head_dim,
    qk-norm, shared experts, expert groups and bias, score function, first dense layers, biases,
    sinks and sliding-window layers."""
    moe = config.moe
    groups = {"num_groups": 4, "group_top_k": 2} if moe.num_groups else {}
    small_moe = dataclasses.replace(
        moe, hidden_size=32, ffn_hidden_size=16, num_experts=8, top_k=min(moe.top_k, 2), init_std=0.2,
        shared_expert_ffn_hidden_size=16 if moe.shared_expert_ffn_hidden_size else None, **groups,
    )
    small = dataclasses.replace(
        config, vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
        num_kv_heads=2 if config.num_kv_heads else None, head_dim=8 if config.head_dim else None,
        ffn_hidden_size=64 if config.ffn_hidden_size else None, max_seq_len=32,
        first_dense_layers=min(config.first_dense_layers, 1), init_std=0.2, moe=small_moe,
        # GPT-OSS: its first sliding and full layers, with a window that binds at max_seq_len.
        layer_types=config.layer_types[:2] if config.layer_types else None,
        sliding_window=min(config.sliding_window, 4) if config.sliding_window else None,
    )
    if config.attention == "mla":  # the published latent widths with init_std 0.2 saturate the softmax
        small = dataclasses.replace(
            small, q_lora_rank=16 if config.q_lora_rank else None, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8,
        )
    return small


@pytest.mark.parametrize("preset", PRESETS)
def test_tensor_parallel_on_every_preset_equals_single_device(preset, tmp_path):
    """TP=2 with EP=2 folded, on each preset's structure (all-MoE presets have no dense FFN)."""
    config = shrink(load_preset(preset))
    results = run_distributed(
        _train_and_compare, 2, {"tp": 2, "etp": 1, "ep": 2}, None, config, timeout_s=180, tmp_dir=tmp_path
    )
    failures = {
        f"rank {rank}: {key}": err for rank, worst in enumerate(results) for key, err in worst.items()
        if exceeds(err, LOSS_TOL if key == "loss" else GRAD_TOL if key.startswith("grad") else WEIGHT_TOL)
    }
    assert not failures, failures


def _sequence_not_divisible(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = MoETransformer(_config())
    parallelize(model, build_parallel_context(ParallelDims(world, tp=2), "cpu"))
    try:
        model(torch.zeros(1, 7, dtype=torch.int64))
    except ValueError as err:
        return str(err)
    return "no error"


def test_sequence_length_must_divide_by_tp(tmp_path):
    messages = run_distributed(_sequence_not_divisible, 2, tmp_dir=tmp_path)
    assert all("Sequence length 7 is not divisible by the tensor parallel size 2" in m for m in messages)
