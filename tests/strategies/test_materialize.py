"""``model_setup.materialize`` gives storage to the meta-device tensors only, and draws only those.

Oracle: the values the model held before (a layer built on the CPU, a torchmetrics metric's
running sums and reset defaults must be kept bit for bit: ``Module.to_empty`` would replace them
with uninitialised memory), and a ``MoELayer`` built directly and drawn from the same seed.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.lit.token_metrics import TokenMeanLoss
from lightning_moe.strategies.model_setup import materialize

CONFIG = MoEConfig(8, 4, 4, top_k=2)


class PartlyMeta(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 8)
        self.metric = TokenMeanLoss()
        with torch.device("meta"):
            self.moe = MoELayer(CONFIG)


def test_only_meta_tensors_are_materialised_and_drawn():
    torch.manual_seed(0)
    model = PartlyMeta()
    model.metric.update(torch.tensor(2.0), torch.tensor(3))
    head = {k: v.clone() for k, v in model.head.state_dict().items()}
    materialize(model, torch.device("cpu"))
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    for key, value in model.head.state_dict().items():
        assert torch.equal(value, head[key]), key
    assert model.metric.loss_sum.item() == 6.0 and model.metric.num_targets.item() == 3
    assert model.metric._defaults["loss_sum"].item() == 0.0 and model.metric._defaults["num_targets"].item() == 0
    direct = MoELayer(CONFIG)
    direct.init_seed = model.moe.init_seed
    direct.reset_parameters()
    for key, value in direct.state_dict().items():
        assert torch.equal(model.moe.state_dict()[key], value), key


class _SeededAndNot(nn.Module):
    """On meta: a MoE layer (drawn from its seed) and a plain linear layer (drawn from the rank's RNG)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.moe = MoELayer(CONFIG)
            self.head = nn.Linear(8, 8)


def _materialize_with_different_rngs(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from lightning_moe.strategies.model_setup import broadcast_initial_state

    torch.manual_seed(0)
    model = _SeededAndNot()
    broadcast_initial_state(model)  # the seeds, as the strategy does before materialising
    torch.manual_seed(100 + rank)  # each rank's own RNG differs from here on
    broadcasts = []
    real = dist.broadcast

    def counted(tensor, *args, **kwargs):
        broadcasts.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    dist.broadcast = counted
    try:
        materialize(model, torch.device("cpu"))
    finally:
        dist.broadcast = real
    return {"broadcasts": broadcasts, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def test_replicated_tensors_agree_and_only_rng_drawn_ones_are_broadcast(tmp_path):
    """Every rank ends with the same values; the seeded MoE layer's tensors are drawn identically on
    every rank, so only the linear layer's weight and bias (drawn from each rank's own RNG) are sent."""
    from helpers.dist import run_distributed

    ranks = run_distributed(_materialize_with_different_rngs, 2, tmp_dir=tmp_path)
    for key, value in ranks[0]["state"].items():
        assert torch.equal(ranks[1]["state"][key], value), key
    for result in ranks:
        assert sorted(result["broadcasts"]) == [(8,), (8, 8)], result["broadcasts"]
