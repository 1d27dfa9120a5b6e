"""The example plans under ``examples/configs/plan/`` are configurations ``fit`` accepts, with the
layout each one's header describes (world size, PP, EP; ``fit``'s own checks as the oracle)."""

from __future__ import annotations

import os
import re

import pytest

from lightning_moe.planning.plan_config import read_layout

PLANS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "plan")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(PLANS) if f.endswith(".yaml")))
def test_an_example_plan_is_a_valid_fit_configuration(name):
    path = os.path.join(PLANS, name)
    with open(path) as f:
        header = f.read().split("\ntrainer:", 1)[0]
    layout = read_layout(["--config", path])  # raises what fit would refuse
    dims = layout.dims
    assert dims.world_size == layout.num_nodes * layout.devices_per_node
    gpus = re.search(r"on (?:(\d+) nodes? x |one node of )?(\d+) GPUs", header)
    assert gpus, f"{name}: the header says on how many GPUs it runs"
    assert (int(gpus[1] or 1)) * int(gpus[2]) == dims.world_size, name
    assert int(re.search(r"_(\d+)gpu\.yaml$", name)[1]) == dims.world_size, name
    for dim, pattern in (("ep", r"EP=(\d+)"), ("pp", r"(\d+) pipeline stages")):
        stated = re.search(pattern, header)
        if stated:
            assert int(stated[1]) == getattr(dims, dim), (name, dim)
