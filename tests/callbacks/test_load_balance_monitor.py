"""`LoadBalanceMonitor` in real Trainer runs: one process with a CSVLogger, and forked gloo ranks.

Oracle: the single-device model (`strategies.toy.ToyNet`, same seed, so the
same weights at every layout) run over the same global micro-batches, its routers' statistics
read directly. The learning rate is 0, so the weights stay at their initial values and every
micro-batch of a run is routed by the same model as in the oracle. Under MoEStrategy each
data-parallel rank's shard is run through the one-device model on its own (as upstream computes
the aux loss per data-parallel rank); token counts are the same whether the shards are run
together or apart, the loss values are averaged over shards as Megatron logs them.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from helpers.dist import run_distributed
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from strategies.toy import ToyNet, loss_fn, make_dataset, quiet_trainer_kwargs, sample_indices, train_loader

from lightning_moe.callbacks import LoadBalanceMonitor
from lightning_moe.layers.router import LOGGED_LOSS_NAMES
from lightning_moe.metrics import figure_to_rgb, render_heatmap
from lightning_moe.strategies import MoEStrategy

PIL_Image = pytest.importorskip("PIL.Image", reason="Pillow (a matplotlib dependency) reads the heatmap PNGs")
LOSS_CONFIG = {"load_balancing": ["aux_loss"], "aux_loss_coeff": 1e-2, "z_loss_coeff": 1e-3}
# fp32 loss values summed in another order (over ranks and micro-batches) than in the oracle.
LOSS_RTOL = 1e-5
LOCAL_BATCH = 2
ACCUMULATE = 2
STEPS = 2


class MonitoredModule(L.LightningModule):
    """Two MoE layers (`ToyNet`), trained with learning rate 0 so the routing never changes."""

    def __init__(self, **config) -> None:
        super().__init__()
        self.net = ToyNet(**config)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return loss_fn(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def oracle(shards_per_micro_batch: list[list[list[int]]], **config) -> dict:
    """Counts per layer and logged losses of the one-device model over the given shards."""
    net = ToyNet(**config).train()
    x, _, _ = make_dataset(64).tensors
    layers = [net.moe1, net.moe2]
    for shards in shards_per_micro_batch:
        for shard in shards:
            net(x[shard]).sum().backward()  # grad enabled: the routers record, once per forward
    counts = torch.stack([layer.router.read_metric_stats()["tokens_per_expert"] for layer in layers])
    losses = [layer.router.logged_losses() for layer in layers]
    return {"tokens_per_expert": counts, "losses": losses}


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_single_process_run_logs_metrics_and_heatmap(tmp_path):
    logger = CSVLogger(tmp_path, name="run")
    monitor = LoadBalanceMonitor(log_every_n_steps=1, heatmap_every_n_steps=2)
    trainer = L.Trainer(
        **quiet_trainer_kwargs(max_steps=STEPS, callbacks=[monitor], logger=logger),
        accumulate_grad_batches=ACCUMULATE,
    )
    trainer.fit(MonitoredModule(**LOSS_CONFIG), train_loader(make_dataset(64)))

    # The last window is optimizer step 2: micro-batches 2 and 3 of the unshuffled loader.
    want = oracle([[[4, 5]], [[6, 7]]], **LOSS_CONFIG)
    result = monitor.last_result
    assert torch.equal(result["tokens_per_expert"], want["tokens_per_expert"])
    assert result["tokens"].tolist() == [2 * LOCAL_BATCH * 4] * 2  # 2 micro-batches of 2 samples x SEQ=4
    assert result["dropped_fraction_total"].item() == 0.0
    for index, layer_losses in enumerate(want["losses"]):
        for name, value in layer_losses.items():
            assert result[name][index].item() == pytest.approx(value.item(), rel=LOSS_RTOL)
    counts = want["tokens_per_expert"].double()
    imbalance = counts.amax(1) / counts.mean(1)
    assert monitor.last_metrics["moe/imbalance_max"] == pytest.approx(imbalance.max().item(), rel=1e-6)
    assert 0 < monitor.last_metrics["moe/router_entropy"] < math.log(8)
    assert trainer.callback_metrics["moe/imbalance_max"].item() == pytest.approx(imbalance.max().item(), rel=1e-6)

    rows = _read_csv(Path(logger.log_dir) / "metrics.csv")
    logged = [row for row in rows if row.get("moe/imbalance_max")]
    assert [int(row["step"]) for row in logged] == [0, 1]  # optimizer step k is Lightning's row k - 1
    assert all(row["epoch"] == "0" for row in logged)
    last = logged[-1]
    for name in ("moe/imbalance_mean", "moe/dropped_fraction", "moe/router_entropy", "moe/load_balancing_loss",
                 "moe/z_loss", "moe/dispatch_bytes", "moe/layer_0/imbalance", "moe/layer_1/z_loss",
                 "moe/layer_1/tokens_per_expert/7", "moe/tokens_per_expert/0"):
        assert last[name] != "", name
    assert float(last["moe/layer_1/tokens_per_expert/7"]) == want["tokens_per_expert"][1, 7].item()
    assert float(last["moe/load_balancing_loss"]) == pytest.approx(
        sum(loss["load_balancing_loss"].item() for loss in want["losses"]) / 2, rel=LOSS_RTOL
    )

    # Heatmap at step 2 only, in the logger's folder, showing the window's counts: pixel for pixel
    # the figure of the oracle's counts (drawing is deterministic), read back with Pillow.
    pngs = sorted(Path(logger.log_dir).glob("expert_load_step*.png"))
    assert [p.name for p in pngs] == ["expert_load_step2.png"] and monitor.heatmap_paths == pngs
    with PIL_Image.open(pngs[0]) as png:
        pixels = np.asarray(png.convert("RGB"))
    assert np.array_equal(pixels, figure_to_rgb(render_heatmap(want["tokens_per_expert"], step=2, first_step=2)))


def test_monitor_sees_every_micro_batch_with_log_every_one(tmp_path):
    """Without accumulation the window is one micro-batch; reports happen at every step."""
    monitor = LoadBalanceMonitor(log_every_n_steps=1, per_layer=False, log_expert_counts=False)
    trainer = L.Trainer(**quiet_trainer_kwargs(max_steps=3, callbacks=[monitor], default_root_dir=tmp_path))
    trainer.fit(MonitoredModule(), train_loader(make_dataset(64)))
    assert torch.equal(monitor.last_result["tokens_per_expert"], oracle([[[4, 5]]])["tokens_per_expert"])
    assert not any("layer_" in name or "tokens_per_expert" in name for name in monitor.last_metrics)
    assert not any(name in monitor.last_result for name in LOGGED_LOSS_NAMES)  # no losses configured
    assert monitor.heatmap_paths == []


class _FakeTensorBoard(TensorBoardLogger):
    """A TensorBoardLogger that records add_figure calls (tensorboard is not installed here)."""

    def __init__(self) -> None:  # deliberately not calling super().__init__: no tensorboard needed
        self.figures = []

    @property
    def experiment(self):
        return self

    def add_figure(self, tag, figure, global_step=None, close=True, walltime=None):
        self.figures.append((tag, figure, global_step, close))


class _FakeWandb(WandbLogger):
    """A WandbLogger that records log_image calls (wandb is not installed here)."""

    def __init__(self) -> None:  # deliberately not calling super().__init__: no wandb needed
        self.images = []

    def log_image(self, key, images, step=None, **kwargs):
        self.images.append((key, images, step))


def test_heatmap_goes_to_tensorboard_and_wandb_as_figures_and_to_other_loggers_as_png(tmp_path):
    monitor = LoadBalanceMonitor(log_every_n_steps=None, heatmap_every_n_steps=1)
    figure = render_heatmap(torch.tensor([[1, 2], [3, 4]]), step=7)
    tensorboard, wandb, csv_logger = _FakeTensorBoard(), _FakeWandb(), CSVLogger(tmp_path / "csv")
    paths = monitor._emit_heatmap([tensorboard, wandb, csv_logger], tmp_path / "root", figure, step=7, row=6)
    # The logger step is Lightning's row number (step - 1), the file is named after the optimizer step.
    assert tensorboard.figures == [("moe/expert_load", figure, 6, False)]
    [(key, images, step)] = wandb.images
    assert (key, step) == ("moe/expert_load", 6) and len(images) == 1
    assert np.array_equal(images[0], figure_to_rgb(figure))
    assert paths == [Path(csv_logger.log_dir) / "expert_load_step7.png"] and paths[0].exists()
    with PIL_Image.open(paths[0]) as png:
        assert np.array_equal(np.asarray(png.convert("RGB")), images[0])
    assert monitor._emit_heatmap([tensorboard, wandb], tmp_path / "root", figure, step=8, row=7) == []
    assert monitor._emit_heatmap([], tmp_path / "root", figure, step=9, row=8) == [
        tmp_path / "root" / "expert_load_step9.png"
    ]


def test_last_window_heatmap_is_written_when_training_ends_early(tmp_path):
    """heatmap_every_n_steps=100 but only 3 steps run: the last window (step 3) is drawn at the end."""
    logger = CSVLogger(tmp_path, name="run")
    monitor = LoadBalanceMonitor(log_every_n_steps=1, heatmap_every_n_steps=100)
    trainer = L.Trainer(**quiet_trainer_kwargs(max_steps=3, callbacks=[monitor], logger=logger))
    trainer.fit(MonitoredModule(), train_loader(make_dataset(64)))
    assert [p.name for p in monitor.heatmap_paths] == ["expert_load_step3.png"]
    want = oracle([[[4, 5]]])["tokens_per_expert"]  # step 3 alone: micro-batch 2
    with PIL_Image.open(monitor.heatmap_paths[0]) as png:
        pixels = np.asarray(png.convert("RGB"))
    assert np.array_equal(pixels, figure_to_rgb(render_heatmap(want, step=3, first_step=3)))


def test_heatmap_only_monitor_draws_the_partial_last_window(tmp_path):
    monitor = LoadBalanceMonitor(log_every_n_steps=None, heatmap_every_n_steps=2)
    trainer = L.Trainer(**quiet_trainer_kwargs(max_epochs=1, limit_train_batches=3, callbacks=[monitor],
                                               default_root_dir=tmp_path))
    trainer.fit(MonitoredModule(), train_loader(make_dataset(64)))
    assert [p.name for p in monitor.heatmap_paths] == ["expert_load_step2.png", "expert_load_step3.png"]
    assert monitor.last_metrics == {}  # no scalars asked for


def test_without_matplotlib_training_warns_once_and_draws_no_heatmap(tmp_path, monkeypatch):
    for name in ("matplotlib.figure", "matplotlib.backends.backend_agg"):  # as if the extra were missing
        monkeypatch.setitem(sys.modules, name, None)
    logger = CSVLogger(tmp_path, name="run")
    monitor = LoadBalanceMonitor(log_every_n_steps=1, heatmap_every_n_steps=1)
    trainer = L.Trainer(**quiet_trainer_kwargs(max_steps=3, callbacks=[monitor], logger=logger))
    with pytest.warns(UserWarning, match=r'matplotlib is not installed.*pip install -e "\.\[plot\]"') as record:
        trainer.fit(MonitoredModule(), train_loader(make_dataset(64)))
    assert sum("matplotlib" in str(w.message) for w in record) == 1
    assert monitor.heatmap_paths == [] and list(Path(logger.log_dir).glob("*.png")) == []
    rows = [row for row in _read_csv(Path(logger.log_dir) / "metrics.csv") if row.get("moe/imbalance_max")]
    assert len(rows) == 3  # the scalars are unaffected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"log_every_n_steps": 0}, r"log_every_n_steps must be a positive integer or None, got 0"),
        ({"log_every_n_steps": None, "heatmap_every_n_steps": None}, r"needs log_every_n_steps or heatmap"),
        ({"log_every_n_steps": 4, "heatmap_every_n_steps": 6}, r"must be a multiple of log_every_n_steps=4"),
    ],
)
def test_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoadBalanceMonitor(**kwargs)


def test_layers_with_different_expert_counts_are_refused(tmp_path):
    module = MonitoredModule()
    module.net.moe2 = ToyNet(num_experts=4).moe2
    trainer = L.Trainer(**quiet_trainer_kwargs(max_steps=1, callbacks=[LoadBalanceMonitor()], default_root_dir=tmp_path))
    with pytest.raises(ValueError, match=r"same num_experts in every MoE layer.*\[4, 8\]"):
        trainer.fit(module, train_loader(make_dataset(8)))


def test_module_without_moe_layers_warns():
    monitor = LoadBalanceMonitor()
    with pytest.warns(UserWarning, match="has no MoELayer"):
        monitor.on_train_start(None, torch.nn.Linear(2, 2))


# -- forked gloo ranks under MoEStrategy --------------------------------------------------------

NUM_SAMPLES = 64
LAYOUTS = {2: [(1, 2)], 4: [(1, 4)]}
"""World size -> (TP, EP) layouts run in one launch; ETP = 1 (TP > 1 needs the reference model's
tensor-parallel plan, which ToyNet does not have)."""


def _fit_layouts(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for tp, ep in LAYOUTS[world_size]:
        monitor = LoadBalanceMonitor(log_every_n_steps=STEPS, heatmap_every_n_steps=STEPS)
        strategy = MoEStrategy(tensor_parallel_size=tp, expert_parallel_size=ep, expert_tensor_parallel_size=1)
        folder = Path(root) / f"tp{tp}-ep{ep}"
        trainer = L.Trainer(
            **quiet_trainer_kwargs(devices=world_size, strategy=strategy, max_steps=STEPS, callbacks=[monitor],
                                   default_root_dir=folder),
            accumulate_grad_batches=ACCUMULATE,
        )
        trainer.fit(MonitoredModule(**LOSS_CONFIG), train_loader(make_dataset(NUM_SAMPLES), LOCAL_BATCH))
        out[(tp, ep)] = {"result": monitor.last_result, "metrics": monitor.last_metrics,
                         "pngs": [str(p) for p in monitor.heatmap_paths]}
    return out


@pytest.fixture(scope="module")
def distributed_runs(tmp_path_factory):
    runs = {}
    for world_size in LAYOUTS:
        root = tmp_path_factory.mktemp(f"monitor_world{world_size}")
        ranks = run_distributed(_fit_layouts, world_size, str(root), timeout_s=240, tmp_dir=root)
        for layout in LAYOUTS[world_size]:
            runs[layout] = (world_size, [r[layout] for r in ranks])
    return runs


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [(1, 2), (1, 4)], ids=["ep2", "ep4"])
def test_counts_under_expert_parallelism_equal_the_single_device_counts(distributed_runs, layout):
    world_size, ranks = distributed_runs[layout]
    dp = world_size // layout[0]
    # One report window: all STEPS * ACCUMULATE micro-batches; each DP rank's shard as the sampler deals it.
    micro_batches = [
        [sample_indices(r, m, NUM_SAMPLES, dp=dp, local_batch=LOCAL_BATCH) for r in range(dp)]
        for m in range(STEPS * ACCUMULATE)
    ]
    want = oracle(micro_batches, **LOSS_CONFIG)
    for rank, r in enumerate(ranks):  # every rank holds the synchronised result
        result = r["result"]
        assert torch.equal(result["tokens_per_expert"], want["tokens_per_expert"]), f"rank {rank}"
        assert result["tokens"].tolist() == [STEPS * ACCUMULATE * dp * LOCAL_BATCH * 4] * 2
        for index, layer_losses in enumerate(want["losses"]):
            for name, value in layer_losses.items():
                assert result[name][index].item() == pytest.approx(value.item(), rel=LOSS_RTOL), (rank, name)
        assert result["dispatch_bytes_total"].item() > 0  # the all-to-all sent rows between EP ranks
        assert r["metrics"]["moe/imbalance_max"] == pytest.approx(ranks[0]["metrics"]["moe/imbalance_max"])
    # Only global rank zero writes the heatmap (no logger: into default_root_dir).
    assert len(ranks[0]["pngs"]) == 1 and Path(ranks[0]["pngs"][0]).name == f"expert_load_step{STEPS}.png"
    assert Path(ranks[0]["pngs"][0]).exists()
    assert all(r["pngs"] == [] for r in ranks[1:])
