"""A process group initialised before the Trainer, over several nodes, without torchrun's variables."""

from __future__ import annotations

import lightning as L
import pytest

from lightning_moe.planning.fake_world import fake_rank
from lightning_moe.strategies import MoEStrategy


@pytest.mark.parametrize(("rank", "local", "node"), [(0, 0, 0), (2, 0, 1), (3, 1, 1)])
def test_local_and_node_rank_follow_the_trainers_devices(monkeypatch, rank, local, node):
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    with fake_rank(rank, 4):
        trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=MoEStrategy(), logger=False)
        strategy = trainer.strategy
        strategy._configure_launcher()
        strategy.set_world_ranks()
        assert (strategy.local_rank, strategy.node_rank, strategy.global_rank) == (local, node, rank)
        assert strategy.root_device.type == "cpu"
