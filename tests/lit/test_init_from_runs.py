"""``MoELanguageModel(init_from=dir)`` under ``MoEStrategy``: validation and the first step see the directory's weights.

Oracle: ``MoETransformer.from_pretrained(dir)`` on one process without a strategy (itself checked
against ``transformers`` in ``tests/models/test_hf_families.py``): ``val_loss`` must be its mean
next-token loss per target over the validation set and ``val_ppl`` the ``exp`` of it (fp32,
``1e-5`` relative). Under the strategy the transformer is built on the meta device and
materialised in setup, which must leave the validation metrics' states alone. Layouts: one
process; on 4 gloo ranks EP=2 (DP=4), EP=2 with ``FULL_SHARD``, and PP=2 x EP=2 (DP=2, each stage
reads only its own tensors), whose first training step's ``train_loss`` must also be the oracle's
loss on that step's samples. Every sequence keeps all its targets and every rank gets whole
batches, so the token mean is the same in every layout.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from helpers.hf import tiny_models
from strategies.toy import quiet_trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe.lit import MoELanguageModel
from lightning_moe.models import MoETransformer
from lightning_moe.models.transformer import next_token_loss

pytest.importorskip("transformers", reason="the test extra installs transformers")
pytest.importorskip("safetensors", reason="the hf and test extras install safetensors")

pytestmark = pytest.mark.distributed

WORLD, SEQ, BATCH, NUM_SEQUENCES = 4, 16, 2, 8
RTOL = 1e-5  # fp32, the same arithmetic up to the order of the reductions
PIPELINE = {"pipeline_parallel_size": 2, "expert_parallel_size": 2, "num_microbatches": 2}
PIPELINE_DP = 2  # WORLD / pipeline_parallel_size
LAYOUTS = {
    "ep2": {"expert_parallel_size": 2},
    "ep2-full-shard": {"expert_parallel_size": 2, "sharding_strategy": "FULL_SHARD"},
    "pp2-ep2": PIPELINE,
}


def dataset() -> TensorDataset:
    tokens = torch.randint(3, 320, (NUM_SEQUENCES, SEQ + 1), generator=torch.Generator().manual_seed(21))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _validate(path: str, devices: int, **sizes) -> dict[str, float]:
    from lightning_moe.strategies import MoEStrategy

    trainer = L.Trainer(**quiet_trainer_kwargs(devices=devices, strategy=MoEStrategy(**sizes)))
    (metrics,) = trainer.validate(MoELanguageModel(init_from=path), DataLoader(dataset(), batch_size=BATCH), verbose=False)
    return {name: float(value) for name, value in metrics.items()}


def _one_process(rank: int, world_size: int, path: str) -> dict:
    return _validate(path, world_size)


def _four_ranks(rank: int, world_size: int, path: str) -> dict:
    from lightning_moe.strategies import MoEStrategy

    results = {name: _validate(path, world_size, **sizes) for name, sizes in LAYOUTS.items()}
    batches = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            batches.append([t.clone() for t in batch])

    trainer = L.Trainer(**quiet_trainer_kwargs(devices=world_size, strategy=MoEStrategy(**PIPELINE), max_steps=1),
                        limit_val_batches=0, callbacks=[Record()])
    trainer.fit(MoELanguageModel(init_from=path, warmup_steps=0), DataLoader(dataset(), batch_size=BATCH))
    # train_loss: the mean over the data-parallel ranks' batches (sync_dist), each rank's batch with it.
    results["pp2-ep2 first step"] = {"train_loss": float(trainer.callback_metrics["train_loss"]), "batch": batches[0]}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(oracle model, one-process metrics, every rank's 4-rank metrics)."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    tiny_models().make_tiny_model(path, "qwen3_moe", texts=["def f(x):\n    return x\n"] * 4)
    tmp = tmp_path_factory.mktemp("runs")
    one = run_distributed(_one_process, 1, str(path), tmp_dir=tmp, timeout_s=120)[0]
    four = run_distributed(_four_ranks, WORLD, str(path), tmp_dir=tmp, timeout_s=300)
    return MoETransformer.from_pretrained(path).eval(), one, four


def oracle_loss(model: MoETransformer, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> float:
    """The mean next-token loss per target of ``model`` on ``inputs`` (default: the whole dataset)."""
    if inputs is None:
        inputs, targets = dataset().tensors
    with torch.no_grad():
        return float(next_token_loss(model(inputs), targets))


def test_val_loss_is_the_weights_loss_on_one_process(runs):
    model, one, _ = runs
    want = oracle_loss(model)
    assert one["val_loss"] == pytest.approx(want, rel=RTOL), one
    assert one["val_ppl"] == pytest.approx(torch.tensor(want).exp().item(), rel=RTOL), one


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_val_loss_is_the_weights_loss_on_four_ranks(runs, layout):
    model, _, four = runs
    want = oracle_loss(model)
    for rank, result in enumerate(four):
        got = result[layout]
        assert got["val_loss"] == pytest.approx(want, rel=RTOL), (rank, got)
        assert got["val_ppl"] == pytest.approx(torch.tensor(want).exp().item(), rel=RTOL), (rank, got)


def test_pipeline_first_step_loss_is_the_weights_loss(runs):
    model, _, four = runs
    # One batch per data-parallel rank (the stages of one replica share theirs), every sequence whole.
    steps = [result["pp2-ep2 first step"] for result in four]
    rows = {tuple(x.tolist()): y for step in steps for x, y in zip(*step["batch"])}  # distinct sequences
    assert len(rows) == PIPELINE_DP * BATCH, len(rows)
    inputs = torch.tensor(list(rows))
    targets = torch.stack(list(rows.values()))
    want = oracle_loss(model, inputs, targets)
    for rank, step in enumerate(steps):
        assert step["train_loss"] == pytest.approx(want, rel=RTOL), rank
