"""`MoEStrategy(context_parallel_size=2, pipeline_parallel_size=2)` equals CP=2 on the whole batches.

Oracle: CP=2 at PP=1 on 2 forked gloo ranks with ``accumulate_grad_batches=M`` on the same
micro-batches (batch size ``B / M``; CP=2 itself equals one process:
``test_context_parallel_fit.py``), each micro-batch's loss weighed by its share of the batch's
kept targets (``M * n_m / N``, counted here from the data): the loss of the whole batch, a mean per
target, while the aux losses stay statistics of each micro-batch, as in the pipeline. On 4 ranks, CP=2 x PP=2 with ``num_microbatches=M=2`` (1F1B,
Interleaved1F1B over 4 stages, and 1F1B with FSDP2 ``FULL_SHARD`` over DP x CP): the loss of every step (the same on every rank), the global
gradient norm, the token-weighted validation loss and perplexity, and every parameter and expert
bias after 3 AdamW steps must match, with clipping, aux, sequence aux and z losses and expert bias
on. Some targets are ignored, so the CP ranks hold different numbers of them: the loss must be the
mean over whole sequences, not of the per-rank means. Each stage's attention must still be the CP
attention after the trim, and its rotary positions the chunks' global ones (else the losses differ).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback
from strategies.toy import quiet_trainer_kwargs, sample_indices
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.lit.module import IGNORE_INDEX
from lightning_moe.models import MoETransformerConfig
from lightning_moe.models.attention import CoreAttention
from lightning_moe.parallel.context_parallel.apply import ContextParallelCoreAttention
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

STEPS, M, BATCH, SEQ, VAL_BATCHES = 3, 2, 4, 16, 2
CLIP = 0.05
SCHEDULES = ("1F1B", "Interleaved1F1B")
RUNS = (*SCHEDULES, "1F1B-FULL_SHARD")
TOL = {"rtol": 1e-5, "atol": 1e-6}
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-5}


def model_config() -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=4, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        first_dense_layers=1, qk_norm=True, max_seq_len=SEQ,
        moe=MoEConfig(
            32, 16, 4, top_k=2, score_func="sigmoid", expert_bias=True, bias_update_rate=1e-2,
            load_balancing=["aux_loss", "seq_aux_loss"], aux_loss_coeff=1e-2, z_loss_coeff=1e-2,
        ),
    )


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (n, SEQ + 1), generator=g)
    targets = tokens[:, 1:].clone()
    targets[torch.rand(targets.shape, generator=g) < 0.4] = IGNORE_INDEX
    targets[1, SEQ // 2:] = IGNORE_INDEX  # the second half of one sequence: one CP rank keeps far fewer
    return TensorDataset(tokens[:, :-1].clone(), targets)


class Measure(Callback):
    def __init__(self, accumulate: int) -> None:
        self.accumulate, self.losses, self.norms = accumulate, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().float() * self.accumulate  # Lightning divides by the accumulation
        if self.accumulate > 1:  # CP=2, PP=1: each CP rank's share (cp_token_mean), averaged over the ranks
            torch.distributed.all_reduce(loss)
            loss /= trainer.world_size
        self.losses.append(loss.item())  # under PP every rank's own value: it must be the whole mean

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.norms.append(trainer.strategy.clip_grad_norm_(float("inf")).item())


def fit(strategy: MoEStrategy, devices: int, batch_size: int, accumulate: int, cls=MoELanguageModel) -> dict:
    torch.manual_seed(0)
    module = cls(model_config(), learning_rate=1e-2, warmup_steps=0)
    measure = Measure(accumulate)
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=devices, strategy=strategy, max_steps=STEPS, callbacks=[measure], accumulate_grad_batches=accumulate,
        gradient_clip_val=CLIP, limit_val_batches=VAL_BATCHES * BATCH // batch_size,
    ))
    trainer.fit(module, DataLoader(dataset(STEPS * BATCH, 1), batch_size=batch_size),
                DataLoader(dataset(VAL_BATCHES * BATCH, 2), batch_size=batch_size))
    attention = [type(m) for m in module.model.modules() if isinstance(m, (CoreAttention, ContextParallelCoreAttention))]
    return {
        "losses": torch.tensor(measure.losses).reshape(STEPS, -1).mean(1), "norms": torch.tensor(measure.norms),
        "val_loss": trainer.callback_metrics["val_loss"], "val_ppl": trainer.callback_metrics["val_ppl"],
        "attention": attention, "blocks": len(module.model.layers),
        "state": {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                  for k, v in module.state_dict().items()},
    }


class TargetWeightedAccumulation(MoELanguageModel):
    """Accumulated micro-batch ``i`` weighs ``weights[i]``: its share of its batch's targets, times M."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        targets = dataset(STEPS * BATCH, 1).tensors[1]
        targets = targets[sample_indices(0, 0, len(targets), dp=1, local_batch=len(targets))]  # the loader's order
        kept = (targets != IGNORE_INDEX).reshape(STEPS, M, -1).sum(-1).float()  # whole sequences: before CP
        self.weights = (kept * M / kept.sum(1, keepdim=True)).flatten()

    def training_step(self, batch, batch_idx: int):
        return super().training_step(batch, batch_idx) * self.weights[batch_idx]


def _reference(rank: int, world_size: int) -> dict:
    return fit(MoEStrategy(context_parallel_size=2), 2, BATCH // M, M, TargetWeightedAccumulation)


def _cp_pp(rank: int, world_size: int) -> dict:
    out = {
        name: fit(MoEStrategy(context_parallel_size=2, pipeline_parallel_size=2, pipeline_schedule=name,
                              num_microbatches=M), 4, BATCH, 1)
        for name in SCHEDULES
    }
    out["1F1B-FULL_SHARD"] = fit(MoEStrategy(context_parallel_size=2, pipeline_parallel_size=2, num_microbatches=M,
                                             sharding_strategy="FULL_SHARD"), 4, BATCH, 1)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp_pp")
    reference = run_distributed(_reference, 2, timeout_s=120, tmp_dir=tmp_path_factory.mktemp("cp_pp_ref"))
    return reference, run_distributed(_cp_pp, 4, timeout_s=240, tmp_dir=tmp)


def test_reference_ranks_agree_and_clip(runs):
    reference, _ = runs
    want = reference[0]
    assert min(want["norms"]) > 2 * CLIP  # clipping was active
    for name, value in reference[1]["state"].items():
        torch.testing.assert_close(value, want["state"][name], rtol=0, atol=0)


@pytest.mark.parametrize("schedule", RUNS)
def test_context_parallel_pipeline_equals_accumulation(runs, schedule):
    reference, ranks = runs
    want = reference[0]
    merged: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(ranks):
        got = result[schedule]
        torch.testing.assert_close(got["losses"], want["losses"], **TOL, msg=lambda m, r=rank: f"rank {r}: {m}")
        torch.testing.assert_close(got["norms"], want["norms"], **TOL, msg=lambda m, r=rank: f"rank {r}: {m}")
        torch.testing.assert_close(got["val_loss"], want["val_loss"], **TOL, msg=lambda m, r=rank: f"rank {r}: {m}")
        torch.testing.assert_close(got["val_ppl"], want["val_ppl"], rtol=1e-5, atol=1e-5)
        for name, value in got["state"].items():
            torch.testing.assert_close(value, want["state"][name], **PARAM_TOL, msg=lambda m, n=name: f"{n}: {m}")
        merged.update(got["state"])
    assert merged.keys() == want["state"].keys()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_trimmed_stages_keep_the_context_parallel_attention(runs, schedule):
    for rank, result in enumerate(runs[1]):
        got = result[schedule]
        assert got["blocks"] == 2, f"rank {rank} holds {got['blocks']} blocks"
        assert got["attention"] == [ContextParallelCoreAttention] * 2, f"rank {rank}: {got['attention']}"
