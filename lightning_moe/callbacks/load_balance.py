"""`LoadBalanceMonitor`: log expert load, token dropping, router entropy and MoE losses while training.

A thin Lightning callback over :class:`~lightning_moe.metrics.ExpertLoadMetric`. The routers
accumulate their statistics in buffers once per training micro-batch (and skip recomputed
forwards), so the callback does nothing per batch: every ``log_every_n_steps`` optimizer steps it
reads and resets every `MoELayer` (router statistics, coefficient-free losses, dispatcher bytes),
sums them over the ranks of the layout with the metric, logs scalars through the Trainer's loggers
on global rank zero and, every ``heatmap_every_n_steps``, the layers x experts load heatmap: an
image for TensorBoard (``add_image``), a PNG ``<log_dir>/expert_load_step<N>.png`` for every other
logger (``default_root_dir`` without loggers).

Works with any strategy: under ``MoEStrategy`` the counts are summed over the ranks of a pipeline
stage (``tp_dp_cp``) with the losses reduced as Megatron Core reports them; elsewhere over the
default process group (DDP) or not at all (one device). See
:mod:`lightning_moe.metrics.load_balance` for why those groups give single-device counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_moe.layers.moe import MoELayer
from lightning_moe.metrics.heatmap import render_heatmap, write_png
from lightning_moe.metrics.load_balance import (
    ExpertLoadMetric,
    flatten_for_logging,
    moe_layers,
    read_layer_stats,
)

__all__ = ["LoadBalanceMonitor"]


def _positive_or_none(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}.")


class LoadBalanceMonitor(Callback):
    """Log MoE load-balance statistics every ``log_every_n_steps`` optimizer steps.

    Args:
        log_every_n_steps: optimizer steps per report window; None logs no scalars (then
            ``heatmap_every_n_steps`` sets the window).
        heatmap_every_n_steps: also emit the expert-load heatmap of the window every this many
            steps (a multiple of ``log_every_n_steps``); None = no heatmap.
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
    per layer ``moe/layer_<i>/imbalance`` etc. Each value covers the window since the previous
    report, summed over micro-batches and ranks. The same values are put in
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
        self._metric: ExpertLoadMetric | None = None
        self._last_report_step = 0
        self._pending_bytes: list[list[int]] = []

    @property
    def _window(self) -> int:
        return self.log_every_n_steps or self.heatmap_every_n_steps

    # -- setup -----------------------------------------------------------------------------------

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._layers = moe_layers(pl_module)
        self._metric = None
        if not self._layers:
            rank_zero_warn("LoadBalanceMonitor: the LightningModule has no MoELayer; nothing will be logged.")
            return
        experts = {layer.config.num_experts for layer in self._layers}
        if len(experts) != 1:
            raise ValueError(
                f"LoadBalanceMonitor needs the same num_experts in every MoE layer (one heatmap row per layer), "
                f"got {sorted(experts)}."
            )
        ctx = getattr(trainer.strategy, "parallel_context", None)
        if ctx is not None:
            group, dp, tp_cp = ctx.group("tp_dp_cp"), ctx.size("dp"), ctx.size("tp_cp")
        else:  # one device, or plain data parallelism over the default group
            group, dp, tp_cp = None, max(1, trainer.world_size), 1
        self._metric = ExpertLoadMetric(
            len(self._layers), experts.pop(), process_group=group, data_parallel_size=dp, tp_cp_size=tp_cp
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
        if self._metric is None or step == self._last_report_step or step % self._window:
            return  # accumulating micro-batch, or not a report step
        self._report(trainer, step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Report the last, partial window (every rank reaches this point: the sync is safe).
        if self._metric is not None and trainer.global_step > self._last_report_step:
            self._report(trainer, trainer.global_step)

    def _collect(self) -> None:
        metric = self._metric
        for index, layer in enumerate(self._layers):
            stats = read_layer_stats(layer, reset=True)
            stats["dispatch_bytes"] = stats.get("dispatch_bytes", 0) + self._pending_bytes[index][0]
            stats["combine_bytes"] = stats.get("combine_bytes", 0) + self._pending_bytes[index][1]
            self._pending_bytes[index] = [0, 0]
            metric.update(index, **stats)

    def _report(self, trainer: Trainer, step: int) -> None:
        """Sum the window over the ranks (a collective: every rank calls it) and log it."""
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
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(self.last_metrics, step=step)
                    logger.save()
        if self.heatmap_every_n_steps is not None and step % self.heatmap_every_n_steps == 0 and trainer.is_global_zero:
            image = render_heatmap(self.last_result["tokens_per_expert"])
            self.heatmap_paths += self._emit_heatmap(trainer.loggers, trainer.default_root_dir, image, step)

    def _emit_heatmap(self, loggers: list, default_dir: str | Path, image: Tensor, step: int) -> list[Path]:
        """TensorBoard loggers get ``add_image``; every other logger's folder (or ``default_dir``) a PNG."""
        folders: list[Path] = []
        for logger in loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image(f"{self.prefix}expert_load", image, global_step=step, dataformats="HWC")
                continue
            folder = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None) or default_dir
            folders.append(Path(folder))
        if not loggers:
            folders.append(Path(default_dir))
        unique = list(dict.fromkeys(folders))
        return [write_png(folder / f"expert_load_step{step}.png", image) for folder in unique]
