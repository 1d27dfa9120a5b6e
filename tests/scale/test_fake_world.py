"""The harness itself: `fake_rank` plays the rank asked for and leaves no process group behind."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from scale.fake_world import fake_rank


def test_fake_rank_plays_the_rank_and_tears_down_even_on_failure():
    with fake_rank(1000, 1024):
        assert (dist.get_rank(), dist.get_world_size()) == (1000, 1024)
    assert not dist.is_initialized()
    with pytest.raises(ZeroDivisionError), fake_rank(3, 64):
        1 / 0  # noqa: B018 (the body fails on purpose)
    assert not dist.is_initialized()
