"""torchmetrics Metrics of MoE training (no Lightning import): expert load and its heatmap."""

from lightning_moe.metrics.heatmap import figure_to_rgb, heatmap_available, render_heatmap, save_heatmap
from lightning_moe.metrics.layer_rows import global_layer_rows
from lightning_moe.metrics.load_balance import (
    ExpertLoadMetric,
    flatten_for_logging,
    moe_layers,
    read_layer_stats,
)

__all__ = [
    "ExpertLoadMetric",
    "figure_to_rgb",
    "flatten_for_logging",
    "global_layer_rows",
    "heatmap_available",
    "moe_layers",
    "read_layer_stats",
    "render_heatmap",
    "save_heatmap",
]
