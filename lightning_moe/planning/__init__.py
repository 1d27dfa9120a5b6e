"""Planning a training run before launching it: what each rank holds and sends in a step of a
``lightning-moe fit`` configuration (`plan`, run on fake tensors as one rank of a fake world), and
which parallel layouts fit a world of ranks, a model and its data."""

from lightning_moe.planning.layouts import (
    STRATEGY_CLASS_PATH,
    Layout,
    command_line,
    cross_node_warnings,
    valid_layouts,
)
from lightning_moe.planning.plan_config import PlanConfigError
from lightning_moe.planning.planner import COMMUNICATION_KINDS, Plan, StagePlan, parse_bytes, plan
from lightning_moe.planning.rank_step import RankStep

__all__ = [
    "COMMUNICATION_KINDS", "STRATEGY_CLASS_PATH", "Layout", "Plan", "PlanConfigError", "RankStep", "StagePlan",
    "command_line", "cross_node_warnings", "parse_bytes", "plan", "valid_layouts",
]
