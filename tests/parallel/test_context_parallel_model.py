"""The reference model under context parallelism equals one device: losses, every gradient, weights after AdamW.

Oracle: the single-device ``MoETransformer`` on the global batch (the same seed, so the same
weights). Each data-parallel replica takes its own samples; the CP ranks of a replica share them
and hold chunks ``r`` and ``2C-1-r`` of every sequence (``shard_batch``). The loss is the mean over
each replica's kept targets (some targets are ignored, so the CP ranks hold different counts:
``cp_token_mean`` must weigh them), the padding mask keeps padded tokens out of the MoE
statistics, and the sequence-level aux loss sees whole sequences. Gradients go through
``GradSync`` (dense over DP x CP, experts over EDP), as in the Lightning strategy.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers.asserts import exceeds, worst_error
from helpers.dist import run_distributed
from parallel.parity import note_gradients, note_weights, step_and_zero

from lightning_moe import MoEConfig
from lightning_moe.layers import set_aux_loss_scale
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.models.transformer import next_token_loss
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize
from lightning_moe.parallel.context_parallel.apply import cp_token_mean, shard_batch
from lightning_moe.parallel.grad_sync import GradSync

pytestmark = pytest.mark.distributed

IGNORE = -100
SEQ = 16  # divisible by 2 x CP x TP
SAMPLES_PER_REPLICA = 2
STEPS = 3
TOL = 1e-5  # losses and gradients: fp32, summed in another order
WEIGHT_TOL = 1e-4  # AdamW divides by sqrt(v): a near-zero gradient's fp32 noise moves its weight more

LAYOUTS = {
    "cp2": (2, {"cp": 2}),
    "cp2-mla": (2, {"cp": 2}),  # multi-head latent attention (DeepSeek-V3), interleaved rope
    "cp4": (4, {"cp": 4}),
    "cp2-ep2-folded": (4, {"cp": 2, "ep": 2}),
    "cp2-tp2": (4, {"cp": 2, "tp": 2, "etp": 1}),
    # GPT-OSS's attention: sinks, o_proj bias, sliding layers with a window of 3 (CP2 chunks hold 4
    # tokens, CP4 chunks 2: a window shorter and longer than a chunk).
    "cp2-oss": (2, {"cp": 2}),
    "cp4-oss": (4, {"cp": 4}),
    "cp2-tp2-oss": (4, {"cp": 2, "tp": 2, "etp": 1}),
}
OSS_ATTENTION = dict(
    num_kv_heads=2, attention_out_bias=True, attention_sinks=True, sliding_window=3,
    layer_types=["sliding_attention", "full_attention"],
)


def _config(mla: bool = False, oss: bool = False) -> MoETransformerConfig:
    attention = OSS_ATTENTION if oss else dict(
        attention="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        rope_interleaved=True,
    ) if mla else dict(num_kv_heads=2, qk_norm=True)
    return MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64,
        first_dense_layers=1, max_seq_len=SEQ, **attention,
        moe=MoEConfig(32, 16, 8, top_k=2, load_balancing=["seq_aux_loss"], aux_loss_coeff=1e-2),
    )


def _batch(step: int, replicas: int):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 64, (SAMPLES_PER_REPLICA * replicas, SEQ + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[torch.rand(targets.shape, generator=gen) < 0.3] = IGNORE  # uneven kept counts per chunk
    padding = torch.ones_like(inputs, dtype=torch.bool)
    padding[0, -3:] = False  # the last tokens of one sequence are padding
    return inputs, targets, padding


def _run(rank: int, world: int, layout: dict, comm_type: str, mla: bool, oss: bool = False) -> dict:
    torch.manual_seed(0)
    reference = MoETransformer(_config(mla, oss))
    model = copy.deepcopy(reference)
    ctx = build_parallel_context(ParallelDims(world, **layout), "cpu")
    parallelize(model, ctx, cp_comm_type=comm_type)
    sync = GradSync(model, ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    dp, dp_rank = ctx.size("dp"), ctx.rank_in("dp")
    # The aux-loss gradient is injected at a scale of its own: CP here, as MoEStrategy sets it (the
    # gradient pre-scale divides by DP x CP); in the oracle, 1/DP, since the oracle's loss is the
    # mean over the DP replicas, each run through the model on its own.
    set_aux_loss_scale(model, float(ctx.size("cp")))
    set_aux_loss_scale(reference, 1.0 / dp)
    errors: dict[str, float] = {}

    def note(key: str, err: float) -> None:
        errors[key] = worst_error(errors.get(key, 0.0), err)

    for step in range(STEPS):
        inputs, targets, padding = _batch(step, dp)
        mine = slice(dp_rank * SAMPLES_PER_REPLICA, (dp_rank + 1) * SAMPLES_PER_REPLICA)
        x, y, mask = shard_batch((inputs[mine], targets[mine], padding[mine]), ctx)
        # The model's own loss: its logits are a vocabulary slice under tensor parallelism.
        loss = cp_token_mean(*model.loss_sum(model(x, padding_mask=mask), y, IGNORE), ctx)
        loss.backward()
        sync.finish()
        # Oracle: the mean over replicas of each replica's token mean, on one device.
        replica_losses = []
        for r in range(dp):
            part = slice(r * SAMPLES_PER_REPLICA, (r + 1) * SAMPLES_PER_REPLICA)
            logits = reference(inputs[part], padding_mask=padding[part])
            replica_losses.append(next_token_loss(logits, targets[part], IGNORE))
        ref_loss = torch.stack(replica_losses).mean()
        ref_loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        # The TP ranks of a (DP, CP) pair hold the same loss: the mean over the world is the DP x CP mean.
        note(f"loss {step}", abs(mean_loss.item() / world - ref_loss.item()))
        note_gradients(note, model, reference)
        step_and_zero(optimizer, ref_optimizer)
    note_weights(note, model, reference)
    return errors


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_context_parallel_training_equals_single_device(layout, comm_type, tmp_path):
    world, sizes = LAYOUTS[layout]
    results = run_distributed(
        _run, world, sizes, comm_type, "mla" in layout, "oss" in layout, timeout_s=180, tmp_dir=tmp_path
    )
    failures = {
        f"rank {rank}: {key}": err for rank, errors in enumerate(results) for key, err in errors.items()
        if exceeds(err, WEIGHT_TOL if key.startswith("weight") else TOL)
    }
    assert not failures, failures
