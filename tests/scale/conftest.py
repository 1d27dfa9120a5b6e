"""Scale tests run in-process on the fake backend; never leave a default process group behind."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_process_group_leaks():
    """A failing test inside `scale.fake_world.fake_rank` already tears down; this guards the rest."""
    assert not dist.is_initialized(), "a default process group leaked into a scale test"
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
