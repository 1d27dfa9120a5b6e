"""What the console says under `MoEStrategy`: deprecation notices once (rank 0), other warnings everywhere."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
from helpers.dist import run_distributed
from strategies.toy import ToyModule, make_dataset, quiet_trainer_kwargs, train_loader

from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed


def _warnings_seen(rank: int, world: int) -> dict:
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=world, strategy=MoEStrategy(expert_parallel_size=2), max_steps=1))
    trainer.fit(ToyModule(), train_loader(make_dataset(16)))
    seen = {}
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        with warnings.catch_warnings(record=True) as record:
            warnings.warn(f"a {category.__name__} from a library", category, stacklevel=1)
        seen[category.__name__] = len(record)
    return seen


def test_deprecations_are_said_once(tmp_path):
    ranks = run_distributed(_warnings_seen, 2, tmp_dir=tmp_path)
    assert ranks[0] == {"FutureWarning": 1, "DeprecationWarning": 1, "UserWarning": 1}
    assert ranks[1] == {"FutureWarning": 0, "DeprecationWarning": 0, "UserWarning": 1}
