"""torchmetrics Metrics of MoE training (no Lightning import): expert load and its heatmap."""

from lightning_moe.metrics.heatmap import encode_png, render_heatmap, write_png
from lightning_moe.metrics.load_balance import (
    ExpertLoadMetric,
    flatten_for_logging,
    moe_layers,
    read_layer_stats,
)

__all__ = [
    "ExpertLoadMetric",
    "encode_png",
    "flatten_for_logging",
    "moe_layers",
    "read_layer_stats",
    "render_heatmap",
    "write_png",
]
