"""Planning a training run before launching it: which parallel layouts fit a world of ranks, a model and its data."""

from lightning_moe.planning.layouts import (
    STRATEGY_CLASS_PATH,
    Layout,
    command_line,
    cross_node_warnings,
    valid_layouts,
)

__all__ = ["STRATEGY_CLASS_PATH", "Layout", "command_line", "cross_node_warnings", "valid_layouts"]
