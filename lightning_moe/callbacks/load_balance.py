"""`LoadBalanceMonitor`: log expert load, token dropping, router entropy and MoE losses while training.

A thin Lightning callback over :class:`~lightning_moe.metrics.ExpertLoadMetric`. The routers
accumulate their statistics in buffers once per training micro-batch (and skip recomputed
forwards), so the callback does nothing per batch: every ``log_every_n_steps`` optimizer steps it
reads and resets every `MoELayer` (router statistics, coefficient-free losses, dispatcher bytes),
sums them over the ranks of the layout with the metric, logs scalars and, every
``heatmap_every_n_steps``, the layers x experts load heatmap (matplotlib, the ``plot`` extra): a
figure for TensorBoard (``add_figure``) and W&B (``log_image``), a PNG
``<log_dir>/expert_load_step<N>.png`` for every other logger (``default_root_dir`` without
loggers). The last window's heatmap is also drawn when training ends, whatever the step count.

Scalars go through ``LightningModule.log`` when Lightning writes its own step metrics after the
batch (``Trainer(log_every_n_steps=...)``), so a CSVLogger puts them on the row of
``self.log(..., on_step=True)`` values such as ``train_loss``. Otherwise (a report between the
Trainer's log steps, or the last partial window, reported in ``on_train_end``) they are written to
the loggers directly, under the same row number and with the epoch, as Lightning would.

Works with any strategy: under ``MoEStrategy`` the counts are summed over the ranks of a pipeline
stage (``tp_dp_cp``) with the losses reduced as Megatron Core reports them; elsewhere over the
default process group (DDP) or not at all (one device). See
:mod:`lightning_moe.metrics.load_balance` for why those groups give single-device counts. Under
pipeline parallelism (``MoEStrategy(pipeline_parallel_size > 1)``) each rank holds only its
stages' layers: they keep their numbers in the whole model
(:func:`~lightning_moe.metrics.layer_rows.global_layer_rows`, one gather over ``pp`` when training
starts) and each report sums the stages' rows over ``pp`` too, so every rank, the logging rank 0
included, reports every MoE layer of the model, with the names and values of one process running
the same micro-batches (the means and maxima over layers taken over all of them). A stage without
MoE layers joins the collectives all the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_moe.compat import logs_this_step, trainer_results
from lightning_moe.layers.moe import MoELayer
from lightning_moe.metrics.heatmap import (
    HEATMAP_EXTRA_HINT,
    figure_to_rgb,
    heatmap_available,
    render_heatmap,
    save_heatmap,
)
from lightning_moe.metrics.layer_rows import global_layer_rows
from lightning_moe.metrics.load_balance import (
    ExpertLoadMetric,
    flatten_for_logging,
    moe_layers,
    read_layer_stats,
)

__all__ = ["LoadBalanceMonitor"]


def _stepped_batches(trainer: Trainer) -> int:
    """Training batches that ended with an optimizer step so far: Lightning's logger step (its rows).

    A private counter (no public equivalent; ``LightningModule.log`` numbers its rows by it too).
    Inside ``on_train_batch_end`` it does not count the batch's own step yet; ``global_step`` does.
    """
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def _positive_or_none(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}.")


class LoadBalanceMonitor(Callback):
    """Log MoE load-balance statistics every ``log_every_n_steps`` optimizer steps.

    Args:
        log_every_n_steps: optimizer steps per report window; None logs no scalars (then
            ``heatmap_every_n_steps`` sets the window).
        heatmap_every_n_steps: also emit the expert-load heatmap of the window every this many
            steps (a multiple of ``log_every_n_steps``), and the last window's at the end of
            training; None = no heatmap. Needs matplotlib (``pip install -e ".[plot]"``);
            without it training warns once and draws none.
        per_layer: log every statistic per layer too (``<prefix>layer_<i>/...``).
        prefix: prefix of every logged name.
        log_expert_counts: log tokens per expert as scalars (``<prefix>tokens_per_expert/<e>``,
            and per layer with ``per_layer``): ``E`` (times ``L``) columns; turn off for large
            models and read the heatmap instead.

    Logged names (see :func:`~lightning_moe.metrics.flatten_for_logging`): ``moe/imbalance_max``,
    ``moe/imbalance_mean``, ``moe/dropped_fraction``, ``moe/router_entropy``, ``moe/tokens``,
    ``moe/dispatch_bytes``, ``moe/combine_bytes``, the losses the routers record under Megatron's
    names (``moe/load_balancing_loss``, ``moe/seq_load_balancing_loss``,
    ``moe/global_load_balancing_loss``, ``moe/z_loss``; coefficient-free, mean over layers), and
    per layer ``moe/layer_<i>/imbalance`` etc., ``i`` the layer's number among the model's MoE
    layers (``modules()`` order; under pipeline parallelism the same numbers, whichever stage holds
    the layer). Each value covers the window since the previous report, summed over micro-batches
    and ranks (every pipeline stage's layers included); the row (logger step) of optimizer step ``k`` is
    ``k - 1``, as for ``self.log`` (module docstring). The same values are put in
    ``trainer.callback_metrics`` (so ``ModelCheckpoint`` can monitor them) and in
    :attr:`last_metrics`; :attr:`last_result` holds the metric's tensors (every rank) and
    :attr:`heatmap_paths` the PNG files written.

    The monitor consumes the routers' ``logged_loss_*`` buffers: with it installed,
    ``router.logged_losses()`` only sees what was recorded since the last report.
    """

    def __init__(
        self,
        log_every_n_steps: int | None = 50,
        heatmap_every_n_steps: int | None = None,
        per_layer: bool = True,
        prefix: str = "moe/",
        log_expert_counts: bool = True,
    ) -> None:
        _positive_or_none("log_every_n_steps", log_every_n_steps)
        _positive_or_none("heatmap_every_n_steps", heatmap_every_n_steps)
        if log_every_n_steps is None and heatmap_every_n_steps is None:
            raise ValueError("LoadBalanceMonitor needs log_every_n_steps or heatmap_every_n_steps (both are None).")
        if log_every_n_steps and heatmap_every_n_steps and heatmap_every_n_steps % log_every_n_steps:
            raise ValueError(
                f"heatmap_every_n_steps={heatmap_every_n_steps} must be a multiple of log_every_n_steps="
                f"{log_every_n_steps} (the heatmap shows the window of a scalar report); e.g. "
                f"heatmap_every_n_steps={log_every_n_steps * max(1, round(heatmap_every_n_steps / log_every_n_steps))}."
            )
        self.log_every_n_steps = log_every_n_steps
        self.heatmap_every_n_steps = heatmap_every_n_steps
        self.per_layer = per_layer
        self.prefix = prefix
        self.log_expert_counts = log_expert_counts
        self.last_metrics: dict[str, float] = {}
        self.last_result: dict[str, Tensor] = {}
        self.heatmap_paths: list[Path] = []
        self._layers: list[MoELayer] = []
        self._rows: list[int] = []  # the metric row (layer number in the whole model) of each of _layers
        self._metric: ExpertLoadMetric | None = None
        self._last_report_step = 0
        self._pending_bytes: list[list[int]] = []
        self._draw_heatmaps = heatmap_every_n_steps is not None
        self._last_window: tuple[int, int] | None = None  # (first, last) optimizer step of the last report
        self._heatmap_step: int | None = None  # last step whose heatmap was emitted
        self._batch_epoch = 0  # epoch of the last training batch (the rows' epoch)
        self._logged_keys: list[str] = []  # Lightning result keys of the last report logged with self.log

    @property
    def _window(self) -> int:
        return self.log_every_n_steps or self.heatmap_every_n_steps

    # -- setup -----------------------------------------------------------------------------------

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._layers = moe_layers(pl_module)
        self._metric = None
        self._last_window = self._heatmap_step = None
        # Read before the check for layers: under PP a rank without MoE layers still numbers the others'.
        ctx = getattr(getattr(trainer, "strategy", None), "parallel_context", None)  # trainer None: no Trainer
        pipeline = ctx.group("pp") if ctx is not None and ctx.size("pp") > 1 else None
        if pipeline is None:
            self._rows = list(range(len(self._layers)))
            layer_experts = [layer.config.num_experts for layer in self._layers]
        else:  # this rank holds its stages' layers only: number them in the whole model (collective over pp)
            self._rows, layer_experts = global_layer_rows(pl_module, self._layers, pipeline)
        if not layer_experts:
            rank_zero_warn("LoadBalanceMonitor: the LightningModule has no MoELayer; nothing will be logged.")
            return
        experts = set(layer_experts)
        if len(experts) != 1:
            raise ValueError(
                f"LoadBalanceMonitor needs the same num_experts in every MoE layer (one heatmap row per layer), "
                f"got {sorted(experts)}."
            )
        if self.heatmap_every_n_steps is not None:
            self._draw_heatmaps = heatmap_available()
            if not self._draw_heatmaps:
                rank_zero_warn(
                    f"LoadBalanceMonitor(heatmap_every_n_steps={self.heatmap_every_n_steps}): matplotlib is not "
                    f"installed, so no expert-load heatmap will be drawn (the scalars are logged as usual); "
                    f"{HEATMAP_EXTRA_HINT}."
                )
        if ctx is not None:
            group, dp, tp_cp = ctx.group("tp_dp_cp"), ctx.size("dp"), ctx.size("tp_cp")
        else:  # one device, or plain data parallelism over the default group
            group, dp, tp_cp = None, max(1, trainer.world_size), 1
        self._metric = ExpertLoadMetric(
            len(layer_experts), experts.pop(), process_group=group, data_parallel_size=dp, tp_cp_size=tp_cp,
            pipeline_group=pipeline,
        ).to(pl_module.device)
        for layer in self._layers:  # drop whatever was recorded before training started
            read_layer_stats(layer, reset=True)
        self._pending_bytes = [[0, 0] for _ in self._layers]
        self._last_report_step = trainer.global_step

    # -- dispatcher traffic outside training -----------------------------------------------------

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Keep the training traffic so far; what validation sends is discarded at its end.
        for pending, layer in zip(self._pending_bytes, self._layers):
            stats = getattr(layer.dispatcher, "stats", None)
            if stats is not None:
                snapshot = stats.reset()
                pending[0] += snapshot.dispatch_bytes
                pending[1] += snapshot.combine_bytes

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for layer in self._layers:
            stats = getattr(layer.dispatcher, "stats", None)
            if stats is not None:
                stats.reset()

    # -- reporting -------------------------------------------------------------------------------

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        self._batch_epoch = trainer.current_epoch  # on_train_end sees the next epoch's number
        if self._metric is None or step == self._last_report_step:
            return  # accumulating micro-batch
        last_step = 0 < trainer.max_steps <= step  # the fit loop stops after this batch
        if step % self._window and not last_step:
            return
        # Lightning numbers this batch's rows by the optimizer steps taken before it.
        self._report(trainer, step, row=_stepped_batches(trainer), pl_module=pl_module)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Take the last report out of Lightning's step results once they have been written.

        Lightning writes every ``on_step`` value logged earlier in the epoch again at each of its
        log steps until the epoch ends; the report would then repeat on later rows as if it were
        theirs. Resetting its entries (private ``_ResultCollection``, keys ``<hook>.<name>``)
        leaves them out until the next report logs them afresh.
        """
        if not self._logged_keys:
            return
        results = trainer_results(trainer)
        for key in self._logged_keys:
            if key in results:
                results[key].reset()
        self._logged_keys = []

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The last, partial window (every rank reaches this point: the sync is safe), on the row of
        # the last optimizer step; then the last window's heatmap if it was not drawn yet.
        row = max(0, _stepped_batches(trainer) - 1)
        if self._metric is not None and trainer.global_step > self._last_report_step:
            self._report(trainer, trainer.global_step, row=row, pl_module=None)
        if self._draw_heatmaps and self._last_window is not None and self._heatmap_step != self._last_window[1]:
            self._heatmap(trainer, row=row)

    def _collect(self) -> None:
        metric = self._metric
        for index, layer in enumerate(self._layers):
            stats = read_layer_stats(layer, reset=True)
            stats["dispatch_bytes"] = stats.get("dispatch_bytes", 0) + self._pending_bytes[index][0]
            stats["combine_bytes"] = stats.get("combine_bytes", 0) + self._pending_bytes[index][1]
            self._pending_bytes[index] = [0, 0]
            metric.update(self._rows[index], **stats)
        if not self._layers:
            # A pipeline stage of dense blocks only still joins the report's collectives; an empty
            # update (it adds zeros) keeps torchmetrics from warning that compute() came first.
            metric.update(0)

    def _report(self, trainer: Trainer, step: int, row: int, pl_module: LightningModule | None) -> None:
        """Sum the window over the ranks (a collective: every rank calls it) and log it on ``row``.

        ``pl_module`` is given inside the training loop, where ``LightningModule.log`` may be used.
        """
        self._last_window = (self._last_report_step + 1, step)
        self._last_report_step = step
        self._collect()
        result = self._metric.compute()
        self._metric.reset()
        self.last_result = {key: value.detach().cpu() for key, value in result.items()}
        if self.log_every_n_steps is not None:
            self.last_metrics = flatten_for_logging(
                self.last_result, self.prefix, per_layer=self.per_layer, expert_counts=self.log_expert_counts
            )
            trainer.callback_metrics.update({k: torch.tensor(v) for k, v in self.last_metrics.items()})
            self._log_scalars(trainer, row, pl_module)
        if self._draw_heatmaps and step % self.heatmap_every_n_steps == 0:
            self._heatmap(trainer, row)

    def _log_scalars(self, trainer: Trainer, row: int, pl_module: LightningModule | None) -> None:
        # Lightning writes its step metrics after this batch only on its own log steps (the same
        # test as its logger connector's); there ``self.log`` puts the values on the row of the
        # module's own step values. float64 CPU tensors: exact counts and no device round trip.
        # Without loggers nothing is written either way (and ``self.log`` would warn per name).
        writes = logs_this_step(trainer)
        if pl_module is not None and trainer.loggers and writes:
            values = {k: torch.tensor(v, dtype=torch.float64) for k, v in self.last_metrics.items()}
            pl_module.log_dict(values, on_step=True, on_epoch=False, sync_dist=False, batch_size=1)
            self._logged_keys = [f"{pl_module._current_fx_name}.{name}" for name in values]
            return
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({**self.last_metrics, "epoch": self._batch_epoch}, step=row)
                logger.save()

    def _heatmap(self, trainer: Trainer, row: int) -> None:
        """Draw the last window's heatmap on global rank zero and hand it to the loggers."""
        first, step = self._last_window
        self._heatmap_step = step
        if not trainer.is_global_zero:
            return
        figure = render_heatmap(self.last_result["tokens_per_expert"], step=step, first_step=first)
        self.heatmap_paths += self._emit_heatmap(trainer.loggers, trainer.default_root_dir, figure, step, row)

    def _emit_heatmap(self, loggers: list, default_dir: str | Path, figure: Any, step: int, row: int) -> list[Path]:
        """TensorBoard gets ``add_figure``, W&B ``log_image`` (at logger step ``row``); every other
        logger's folder (or ``default_dir`` without loggers) a PNG named after optimizer step ``step``."""
        tag = f"{self.prefix}expert_load"
        folders: list[Path] = []
        for logger in loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_figure(tag, figure, global_step=row, close=False)
            elif isinstance(logger, WandbLogger):
                logger.log_image(key=tag, images=[figure_to_rgb(figure)], step=row)
            else:
                folder = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None) or default_dir
                folders.append(Path(folder))
        if not loggers:
            folders.append(Path(default_dir))
        unique = list(dict.fromkeys(folders))
        return [save_heatmap(folder / f"expert_load_step{step}.png", figure) for folder in unique]
