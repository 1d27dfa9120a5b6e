"""`MoEStrategy(pipeline_parallel_size=2)` under Lightning equals one process with gradient accumulation.

Oracle: one process (``MoEStrategy()`` at world size 1) with ``accumulate_grad_batches=M`` on the
same micro-batches (batch size ``B / M``). On 2 forked gloo ranks, PP=2 with every schedule and
``num_microbatches=M=4``: the loss of every step (logged from the last stage on both ranks), the
global gradient norm (over both stages) the validation loss, and every parameter and expert bias
after 3 AdamW steps must match, with aux loss, z loss, expert bias and clipping on. Each rank
holds only its stages' parameters, under their global names.

When the micro-batches keep very different numbers of targets (one none at all), the pipeline's loss
is still the mean per target token of the whole batch, as at PP=1: oracle, one process on the whole
batch (no accumulation; the batch-level aux loss is off, since it is a statistic of each micro-batch).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.asserts import assert_states_close
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback
from strategies.toy import quiet_trainer_kwargs, sample_indices
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.lit.module import IGNORE_INDEX
from lightning_moe.models import MoETransformerConfig
from lightning_moe.parallel.pipeline.runner import PIPELINE_SCHEDULES
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

STEPS, M, BATCH, SEQ = 3, 4, 8, 8
CLIP = 0.05
SCHEDULES = list(PIPELINE_SCHEDULES)


def model_config(aux_loss: bool = True) -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=4, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        first_dense_layers=1, max_seq_len=SEQ,
        moe=MoEConfig(
            32, 16, 4, top_k=2, score_func="sigmoid", expert_bias=True, bias_update_rate=1e-2,
            load_balancing=["aux_loss"] if aux_loss else [], aux_loss_coeff=1e-2 if aux_loss else 0.0,
            z_loss_coeff=1e-2,
        ),
    )


def dataset(n: int, uneven: bool = False) -> TensorDataset:
    tokens = torch.randint(0, 64, (n, SEQ + 1), generator=torch.Generator().manual_seed(n))
    targets = tokens[:, 1:].clone()
    if uneven:  # micro-batches of BATCH // M rows, in the loader's order: none, 1, SEQ and all 2 * SEQ targets kept
        kept = torch.zeros(n // BATCH, M, BATCH // M * SEQ, dtype=torch.bool)
        kept[:, 1, :1] = True
        kept[:, 2, :SEQ] = True
        kept[:, 3] = True
        in_rows = torch.empty(n, SEQ, dtype=torch.bool)
        in_rows[sample_indices(0, 0, n, dp=1, local_batch=n)] = kept.reshape(n, SEQ)
        targets[~in_rows] = IGNORE_INDEX
    return TensorDataset(tokens[:, :-1], targets)


class Measure(Callback):
    def __init__(self, scale: float) -> None:
        self.scale, self.losses, self.norms, self.kept = scale, [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item() * self.scale)  # Lightning divides by the accumulation
        self.kept.append((batch[1] != IGNORE_INDEX).reshape(-1, BATCH // M * SEQ).sum(1).tolist())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.norms.append(trainer.strategy.clip_grad_norm_(float("inf")).item())


def fit(strategy: MoEStrategy, batch_size: int, accumulate: int, uneven: bool = False) -> dict:
    torch.manual_seed(0)
    module = MoELanguageModel(model_config(aux_loss=not uneven), learning_rate=1e-2, warmup_steps=0)
    measure = Measure(accumulate)
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=strategy_devices(strategy), strategy=strategy, max_steps=STEPS, callbacks=[measure],
        accumulate_grad_batches=accumulate, gradient_clip_val=CLIP, limit_val_batches=BATCH // batch_size,
    ))
    trainer.fit(module, DataLoader(dataset(STEPS * BATCH, uneven), batch_size=batch_size),
                DataLoader(dataset(BATCH, uneven), batch_size=batch_size))
    losses = torch.tensor(measure.losses).reshape(STEPS, -1).mean(1)
    return {
        "losses": losses, "norms": torch.tensor(measure.norms), "kept": measure.kept, "val_loss": trainer.callback_metrics["val_loss"],
        "state": {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                  for k, v in module.state_dict().items()},
    }


def strategy_devices(strategy: MoEStrategy) -> int:
    return strategy.sizes["pp"]


def _pipeline_runs(rank: int, world_size: int) -> dict:
    out = {
        name: fit(MoEStrategy(pipeline_parallel_size=2, pipeline_schedule=name, num_microbatches=M), BATCH, 1)
        for name in SCHEDULES
    }
    out["uneven"] = fit(MoEStrategy(pipeline_parallel_size=2, num_microbatches=M), BATCH, 1, uneven=True)
    try:  # refused at setup, before any step
        fit(MoEStrategy(pipeline_parallel_size=2, num_microbatches=M), BATCH, 2)
    except ValueError as err:
        out["refusal"] = str(err)
    try:
        fit(MoEStrategy(pipeline_parallel_size=2, num_microbatches=M, save_distributed_checkpoint=False), BATCH, 1)
    except ValueError as err:
        out["consolidated refusal"] = str(err)
    return out


def _reference(rank: int, world_size: int) -> dict:
    return {**fit(MoEStrategy(), BATCH // M, M), "uneven": fit(MoEStrategy(), BATCH, 1, uneven=True)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_parity")
    return run_distributed(_reference, 1, timeout_s=120, tmp_dir=tmp)[0], run_distributed(
        _pipeline_runs, 2, timeout_s=300, tmp_dir=tmp)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_equals_accumulation(runs, schedule):
    want, ranks = runs
    assert min(want["norms"]) > 2 * CLIP  # clipping was active
    merged: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(ranks):
        got = result[schedule]
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["norms"], want["norms"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["val_loss"], want["val_loss"], rtol=1e-5, atol=1e-6)
        assert not merged.keys() & got["state"].keys(), f"rank {rank} holds keys of the other stage"
        merged.update(got["state"])
    assert_states_close(merged, want["state"], rtol=1e-5, atol=1e-5)


def test_micro_batches_weigh_by_their_targets(runs):
    want, ranks = runs
    want = want["uneven"]
    for result in ranks:
        got = result["uneven"]
        assert got["kept"] == [[0, 1, SEQ, 2 * SEQ]] * STEPS  # the targets each micro-batch kept
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["norms"], want["norms"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["val_loss"], want["val_loss"], rtol=1e-5, atol=1e-6)
        for name, value in got["state"].items():
            torch.testing.assert_close(value, want["state"][name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_expert_bias_and_weights_moved(runs):
    torch.manual_seed(0)
    initial = MoELanguageModel(model_config())
    initial.configure_model()
    start, want = initial.state_dict(), runs[0]["state"]
    assert not torch.equal(want["model.layers.1.ffn.router.expert_bias"], start["model.layers.1.ffn.router.expert_bias"])
    assert not torch.equal(want["model.layers.3.ffn.experts.fc1_weight"], start["model.layers.3.ffn.experts.fc1_weight"])


def test_accumulation_is_refused_under_pipeline_parallelism(runs):
    for result in runs[1]:
        assert "accumulate_grad_batches=2 (use num_microbatches" in result["refusal"]
        assert "save_distributed_checkpoint=False (rank 0's file" in result["consolidated refusal"]
