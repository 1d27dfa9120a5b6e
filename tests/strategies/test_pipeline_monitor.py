"""`LoadBalanceMonitor` under pipeline parallelism reports the whole model, as one process does.

Oracle: one process (``MoEStrategy()`` at world size 1) with ``accumulate_grad_batches=M`` on the
same micro-batches, whose monitor sees every MoE layer (itself checked against the routers'
counts by ``tests/callbacks``). On 2 forked gloo ranks, PP=2 with ``num_microbatches=M`` and
``LoadBalanceMonitor(log_every_n_steps=1)`` (per-layer values and expert counts on) must report,
on every rank and in the rows the logger receives from global rank 0, the same names (layers
numbered in the whole model) and values at every step, and the same heatmap rows. Layouts: 1F1B
with the default split (stage 0: one MoE layer, stage 1: two), 1F1B with ``[1, 3]`` (stage 0
holds no MoE layer at all, yet must join the report's collectives) and Interleaved1F1B with one
block per stage (each rank's layers interleave with the other's). The layer numbering itself is
checked against the unsplit model's ``modules()`` order, and two ranks holding the same layer are
refused.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from strategies.test_pipeline_parity import dataset, model_config
from strategies.toy import quiet_trainer_kwargs
from torch.utils.data import DataLoader

from lightning_moe.callbacks import LoadBalanceMonitor
from lightning_moe.lit import MoELanguageModel
from lightning_moe.metrics import global_layer_rows, moe_layers
from lightning_moe.metrics.layer_rows import module_position
from lightning_moe.models import MoETransformer
from lightning_moe.parallel.pipeline.split import pipeline_parts_of, trim_to_stages
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

STEPS, M, BATCH = 2, 2, 4
LAYOUTS = {  # name: (pipeline_schedule, pipeline_layer_split)
    "1F1B": ("1F1B", None),
    "1F1B, no MoE layer on stage 0": ("1F1B", [1, 3]),
    "Interleaved1F1B": ("Interleaved1F1B", [1, 1, 1, 1]),
}


class RowLogger(Logger):
    """Keeps the ``moe/`` values of every row Lightning writes (on every rank: no rank-zero filter)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "rows"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        moe = {k: float(v) for k, v in metrics.items() if k.startswith("moe/")}
        if moe:
            self.rows.setdefault(step, {}).update(moe)


class Reports(Callback):
    """The monitor's report of every step (it runs before this callback)."""

    def __init__(self, monitor: LoadBalanceMonitor) -> None:
        self.monitor, self.reports = monitor, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step > len(self.reports):  # an optimizer step ended: the monitor reported
            self.reports.append(dict(self.monitor.last_metrics))


def _fit(pp: int, schedule: str = "1F1B", split: list[int] | None = None) -> dict:
    torch.manual_seed(0)
    module = MoELanguageModel(model_config(), learning_rate=1e-2, warmup_steps=0)
    accumulate = 1 if pp > 1 else M
    monitor = LoadBalanceMonitor(log_every_n_steps=1, per_layer=True, log_expert_counts=True)
    reports, logger = Reports(monitor), RowLogger()
    strategy = MoEStrategy(pipeline_parallel_size=pp, pipeline_schedule=schedule,
                           num_microbatches=M if pp > 1 else None, pipeline_layer_split=split)
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=pp, strategy=strategy, max_steps=STEPS, callbacks=[monitor, reports], logger=logger,
        accumulate_grad_batches=accumulate, limit_val_batches=0, log_every_n_steps=1,
    ))
    trainer.fit(module, DataLoader(dataset(STEPS * BATCH), batch_size=BATCH // accumulate))
    return {"reports": reports.reports, "rows": logger.rows,
            "heatmap": monitor.last_result.get("tokens_per_expert")}


def _pipeline_runs(rank: int, world_size: int) -> dict:
    return {name: _fit(2, schedule, split) for name, (schedule, split) in LAYOUTS.items()}


def _reference(rank: int, world_size: int) -> dict:
    return _fit(1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_monitor")
    return run_distributed(_reference, 1, timeout_s=120, tmp_dir=tmp)[0], run_distributed(
        _pipeline_runs, 2, timeout_s=300, tmp_dir=tmp)


def _assert_same(got: dict[str, float], want: dict[str, float], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(got.keys() ^ want.keys())}"
    for name, value in want.items():
        torch.testing.assert_close(
            torch.tensor(got[name], dtype=torch.float64), torch.tensor(value, dtype=torch.float64),
            rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{what} {n}: {m}",
        )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_monitor_equals_one_process(runs, layout):
    want, ranks = runs
    assert len(want["reports"]) == STEPS and sorted(want["rows"]) == list(range(STEPS))
    assert {"moe/layer_2/imbalance", "moe/layer_2/tokens_per_expert/0", "moe/load_balancing_loss",
            "moe/z_loss"} <= want["reports"][0].keys()  # three MoE layers, losses recorded
    assert all(torch.isfinite(torch.tensor(list(r.values()))).all() for r in want["reports"])
    for rank, result in enumerate(ranks):
        got = result[layout]
        assert len(got["reports"]) == STEPS, (rank, len(got["reports"]))
        for step, (report, expected) in enumerate(zip(got["reports"], want["reports"])):
            _assert_same(report, expected, f"rank {rank} step {step + 1} report")
        assert got["heatmap"] is not None, f"rank {rank} kept no report"
        torch.testing.assert_close(got["heatmap"], want["heatmap"], rtol=0, atol=0)
    rows = ranks[0][layout]["rows"]  # what Lightning writes (global rank 0)
    assert sorted(rows) == sorted(want["rows"])
    for step, expected in want["rows"].items():
        _assert_same(rows[step], expected, f"logged row {step}")


def test_positions_follow_the_unsplit_models_order():
    model = MoETransformer(model_config())
    names = {id(m): n for n, m in model.named_modules()}
    layers = moe_layers(model)
    positions = [module_position(model, names[id(layer)]) for layer in layers]
    assert len(layers) == 3 and positions == sorted(positions), positions
    # Trimmed to a later stage's blocks (an nn.ModuleDict keyed by the original indices, the
    # embedding dropped), the kept layers keep their positions.
    trim_to_stages(model, pipeline_parts_of(model), {2, 3}, first=False, last=True)
    kept = {id(m): n for n, m in model.named_modules()}
    assert [module_position(model, kept[id(layer)]) for layer in moe_layers(model)] == positions[1:]


def _untrimmed(rank: int, world_size: int) -> str:
    model = MoETransformer(model_config())
    try:
        global_layer_rows(model, moe_layers(model), dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_the_same_layer_on_two_ranks_is_refused(tmp_path):
    for message in run_distributed(_untrimmed, 2, timeout_s=60, tmp_dir=tmp_path):
        assert "held by several pipeline ranks (layers.1.ffn on ranks [0, 1], layers.2.ffn" in message, message
