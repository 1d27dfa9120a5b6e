"""`LoadBalanceMonitor` on the smallest layouts and on the rows of ``metrics.csv``.

* One MoE layer (torchmetrics squeezes one-element results: ``[1] -> []``), one expert, one
  expert-parallel rank and one expert per rank, through ``Trainer.fit``. Oracle: the same
  one-layer network run on one device over the same micro-batches, its router's statistics read
  directly (learning rate 0, so every micro-batch is routed by the initial weights).
* CSVLogger rows: the ``moe/*`` values must use the step numbering of ``self.log(on_step=True)``
  (Lightning's rows of optimizer step ``k`` are numbered ``k - 1``) and share the ``train_loss``
  row where Lightning writes one; every row has an epoch.
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from lightning.pytorch.loggers import CSVLogger
from strategies.toy import (
    HIDDEN,
    IN_FEATURES,
    SEQ,
    loss_fn,
    make_config,
    make_dataset,
    quiet_trainer_kwargs,
    sample_indices,
    train_loader,
)
from torch import nn

from lightning_moe import MoELayer
from lightning_moe.callbacks import LoadBalanceMonitor
from lightning_moe.strategies import MoEStrategy

LOCAL_BATCH = 2
NUM_SAMPLES = 32
ONE_EXPERT = {"num_experts": 1, "top_k": 1, "pre_softmax": True}  # top-1 softmax needs pre_softmax
# fp32 loss values summed in another order than in the oracle.
LOSS_RTOL = 1e-5


class OneLayerNet(nn.Module):
    """Linear in, one residual MoE layer, linear head (seeded: the same weights everywhere)."""

    def __init__(self, **config) -> None:
        super().__init__()
        torch.manual_seed(4321)
        self.inp = nn.Linear(IN_FEATURES, HIDDEN)
        self.moe = MoELayer(make_config(z_loss_coeff=1e-3, **config))
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x):
        h = self.inp(x)
        return self.head(h + self.moe(h))


class OneLayerModule(L.LightningModule):
    """`OneLayerNet` trained with learning rate 0; logs ``train_loss`` per step."""

    def __init__(self, **config) -> None:
        super().__init__()
        self.net = OneLayerNet(**config)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = loss_fn(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def one_layer_oracle(shards: list[list[int]], **config) -> dict:
    """Counts ``[1, E]`` and logged losses of the one-device `OneLayerNet` over ``shards``."""
    net = OneLayerNet(**config).train()
    x = make_dataset(NUM_SAMPLES).tensors[0]
    for shard in shards:
        net(x[shard]).sum().backward()  # grad enabled: the router records, once per forward
    counts = net.moe.router.read_metric_stats()["tokens_per_expert"].unsqueeze(0)
    return {"tokens_per_expert": counts, "losses": net.moe.router.logged_losses()}


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


@pytest.mark.parametrize("config", [{}, ONE_EXPERT], ids=["one-layer", "one-layer-one-expert"])
def test_one_layer_model_is_monitored_through_fit(tmp_path, config):
    logger = CSVLogger(tmp_path, name="run")
    monitor = LoadBalanceMonitor(log_every_n_steps=2, heatmap_every_n_steps=2)
    trainer = L.Trainer(**quiet_trainer_kwargs(max_steps=2, callbacks=[monitor], logger=logger, log_every_n_steps=1))
    trainer.fit(OneLayerModule(**config), train_loader(make_dataset(NUM_SAMPLES), LOCAL_BATCH))

    experts = config.get("num_experts", 8)
    want = one_layer_oracle([[0, 1], [2, 3]], **config)  # the window: micro-batches 0 and 1, unshuffled
    result = monitor.last_result
    assert result["tokens_per_expert"].shape == (1, experts)
    assert torch.equal(result["tokens_per_expert"], want["tokens_per_expert"])
    assert result["tokens"].tolist() == [2 * LOCAL_BATCH * SEQ]
    assert result["z_loss"].shape == (1,)
    torch.testing.assert_close(result["z_loss"], want["losses"]["z_loss"].reshape(1), rtol=LOSS_RTOL, atol=0)
    metrics = monitor.last_metrics
    counts = want["tokens_per_expert"][0].double()
    assert metrics["moe/imbalance_max"] == pytest.approx((counts.max() / counts.mean()).item(), rel=1e-6)
    assert metrics["moe/layer_0/imbalance"] == metrics["moe/imbalance_max"]
    for e in range(experts):
        assert metrics[f"moe/tokens_per_expert/{e}"] == counts[e].item()
        assert metrics[f"moe/layer_0/tokens_per_expert/{e}"] == counts[e].item()
    assert not any(name.startswith("moe/layer_1/") for name in metrics)
    if experts == 1:
        assert metrics["moe/imbalance_max"] == 1.0 and metrics["moe/router_entropy"] == 0.0
    rows = [row for row in _read_csv(Path(logger.log_dir) / "metrics.csv") if row.get("moe/imbalance_max")]
    assert len(rows) == 1 and float(rows[0]["moe/layer_0/tokens_per_expert/0"]) == counts[0].item()
    assert [p.name for p in monitor.heatmap_paths] == ["expert_load_step2.png"]


def test_moe_values_share_the_rows_of_train_loss(tmp_path):
    """Trainer writes every step: each report lands on its step's ``train_loss`` row."""
    logger = CSVLogger(tmp_path, name="run")
    monitor = LoadBalanceMonitor(log_every_n_steps=2, per_layer=False, log_expert_counts=False)
    trainer = L.Trainer(
        **quiet_trainer_kwargs(max_steps=5, callbacks=[monitor], logger=logger, log_every_n_steps=1),
        accumulate_grad_batches=2,
    )
    trainer.fit(OneLayerModule(), train_loader(make_dataset(NUM_SAMPLES), LOCAL_BATCH))

    rows = _read_csv(Path(logger.log_dir) / "metrics.csv")
    assert rows and all(row["epoch"] != "" for row in rows), rows
    moe_rows = [row for row in rows if row["moe/imbalance_max"] != ""]
    # Reports after optimizer steps 2 and 4, and the last, partial window at step 5 (max_steps).
    assert [int(row["step"]) for row in moe_rows] == [1, 3, 4]
    assert all(row["train_loss"] != "" for row in moe_rows)
    assert [row["step"] for row in rows if row["train_loss"] == ""] == []  # no row of its own
    # The row's value is the report of that window (the last one: step 5 alone).
    assert float(moe_rows[-1]["moe/imbalance_max"]) == pytest.approx(monitor.last_metrics["moe/imbalance_max"])


def test_reports_between_the_trainers_log_steps_keep_the_numbering(tmp_path):
    """Trainer writes every 3rd step, the monitor reports every 2nd: own rows, same numbering, an epoch."""
    logger = CSVLogger(tmp_path, name="run")
    monitor = LoadBalanceMonitor(log_every_n_steps=2, per_layer=False, log_expert_counts=False)
    trainer = L.Trainer(**quiet_trainer_kwargs(max_steps=6, callbacks=[monitor], logger=logger, log_every_n_steps=3))
    trainer.fit(OneLayerModule(), train_loader(make_dataset(NUM_SAMPLES), LOCAL_BATCH))

    rows = _read_csv(Path(logger.log_dir) / "metrics.csv")
    assert rows and all(row["epoch"] == "0" for row in rows), rows
    assert [int(row["step"]) for row in rows if row["train_loss"] != ""] == [2, 5]
    moe_steps = [int(row["step"]) for row in rows if row["moe/imbalance_max"] != ""]
    assert moe_steps == [1, 3, 5]  # optimizer steps 2, 4 and 6; step 6 shares Lightning's row
    shared = [row for row in rows if row["step"] == "5"]
    assert len(shared) == 1 and shared[0]["train_loss"] != "" and shared[0]["moe/imbalance_max"] != ""


def test_last_partial_window_after_the_last_epoch_gets_the_last_row_number(tmp_path):
    """Training ends with the epoch (no max_steps): the partial window is reported at the end, row 4."""
    logger = CSVLogger(tmp_path, name="run")
    monitor = LoadBalanceMonitor(log_every_n_steps=2, per_layer=False, log_expert_counts=False)
    trainer = L.Trainer(**quiet_trainer_kwargs(max_epochs=1, limit_train_batches=5, callbacks=[monitor],
                                               logger=logger, log_every_n_steps=1))
    trainer.fit(OneLayerModule(), train_loader(make_dataset(NUM_SAMPLES), LOCAL_BATCH))

    rows = _read_csv(Path(logger.log_dir) / "metrics.csv")
    assert rows and all(row["epoch"] == "0" for row in rows), rows
    assert [int(row["step"]) for row in rows if row["moe/imbalance_max"] != ""] == [1, 3, 4]
    assert max(int(row["step"]) for row in rows if row["train_loss"] != "") == 4
    want = one_layer_oracle([[8, 9]])  # step 5 alone: the 5th micro-batch
    assert torch.equal(monitor.last_result["tokens_per_expert"], want["tokens_per_expert"])


# -- forked gloo ranks under MoEStrategy: one EP rank, and one expert per rank ------------------

LAYOUTS = [(1, {}), (2, {"num_experts": 2})]
"""(EP, config) on 2 ranks: EP=1 (the experts replicated over DP=2) and EP=2 with 2 experts."""


def _fit_one_layer(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for ep, config in LAYOUTS:
        monitor = LoadBalanceMonitor(log_every_n_steps=2, heatmap_every_n_steps=2)
        strategy = MoEStrategy(expert_parallel_size=ep, expert_tensor_parallel_size=1)
        trainer = L.Trainer(**quiet_trainer_kwargs(devices=world_size, strategy=strategy, max_steps=2,
                                                   callbacks=[monitor], default_root_dir=Path(root) / f"ep{ep}"))
        trainer.fit(OneLayerModule(**config), train_loader(make_dataset(NUM_SAMPLES), LOCAL_BATCH))
        out[ep] = {"result": monitor.last_result, "metrics": monitor.last_metrics,
                   "pngs": [p.name for p in monitor.heatmap_paths]}
    return out


@pytest.mark.distributed
def test_one_layer_under_one_ep_rank_and_one_expert_per_rank(tmp_path):
    ranks = run_distributed(_fit_one_layer, 2, str(tmp_path), timeout_s=240, tmp_dir=tmp_path)
    for ep, config in LAYOUTS:
        shards = [sample_indices(r, m, NUM_SAMPLES, dp=2, local_batch=LOCAL_BATCH) for m in range(2) for r in range(2)]
        want = one_layer_oracle(shards, **config)
        for rank, by_layout in enumerate(ranks):
            got = by_layout[ep]
            assert torch.equal(got["result"]["tokens_per_expert"], want["tokens_per_expert"]), (ep, rank)
            assert got["result"]["tokens"].tolist() == [2 * 2 * LOCAL_BATCH * SEQ], (ep, rank)
            if ep > 1:
                assert got["result"]["dispatch_bytes_total"].item() > 0  # tokens crossed ranks
            assert got["metrics"]["moe/layer_0/imbalance"] == got["metrics"]["moe/imbalance_max"]
        assert ranks[0][ep]["pngs"] == ["expert_load_step2.png"] and ranks[1][ep]["pngs"] == []



@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_reports_share_rows_and_stay_exact(tmp_path, accelerator):
    """The self.log path under bf16 autocast (CUDA: module on the GPU; CPU: the proxy of the logic).

    No fp32 oracle of the routing (bf16 changes the choices); the invariants are exact: every token
    routed to TOP_K experts without drops, values back on the CPU, and the CSV holding the
    reported counts digit for digit.
    """
    logger = CSVLogger(tmp_path, name="run")
    monitor = LoadBalanceMonitor(log_every_n_steps=2)
    trainer = L.Trainer(**quiet_trainer_kwargs(accelerator=accelerator, devices=1, precision="bf16-mixed",
                                               max_steps=4, callbacks=[monitor], logger=logger, log_every_n_steps=1))
    trainer.fit(OneLayerModule(), train_loader(make_dataset(NUM_SAMPLES), LOCAL_BATCH))

    result = monitor.last_result
    assert all(value.device.type == "cpu" for value in result.values())
    tokens = 2 * LOCAL_BATCH * SEQ
    assert result["tokens"].tolist() == [tokens] and result["tokens_per_expert"].sum().item() == tokens * 2
    rows = _read_csv(Path(logger.log_dir) / "metrics.csv")
    moe_rows = [row for row in rows if row["moe/imbalance_max"] != ""]
    assert [int(row["step"]) for row in moe_rows] == [1, 3] and all(row["train_loss"] != "" for row in moe_rows)
    counts = [float(moe_rows[-1][f"moe/tokens_per_expert/{e}"]) for e in range(8)]
    assert counts == [float(c) for c in result["tokens_per_expert_total"].tolist()]
