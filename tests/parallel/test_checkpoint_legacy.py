"""Checkpoints of the older gated-fc1 layout ``experts.fc1_weight`` ``[E, 2F, H]`` still load.

The state dict now presents a gated fc1 as ``[E, 2, F, H]`` (gate, up). Older checkpoints are
written here the way the older code wrote them: a single-file state dict and a sharded DCP folder
(weights and AdamW moments keyed by parameter name, as ``MoEStrategy`` saves them) whose fc1
entries are ``[E, 2F, H]``. The oracle: the older layout is the gate rows then the up rows of each
expert, so the values must come back as ``old.view(E, 2, F, H)``, and each rank must hold its
slice of them, written here independently of the library's slicing. The saved values are the
model's initial weights plus noise, so a load that silently kept the initial weights fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.dist import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe import MoEConfig
from lightning_moe.checkpoint.entries import check_entries, expected_entries
from lightning_moe.checkpoint.legacy import adopt_legacy_fc1
from lightning_moe.checkpoint.security import read_dcp_metadata
from lightning_moe.checkpoint.sharded import (
    distribute_full_tensors,
    init_optimizer_state,
    load_optimizer_state_dict,
    load_sharded,
    optimizer_state_dict,
)
from lightning_moe.layers.moe import MoELayer
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize
from lightning_moe.parallel.expert_parallel import ExpertStateConverter

H, F, E, TOP_K = 16, 8, 4, 2
"""Hidden, expert ffn (divisible by ETP=2), experts (divisible by EP=2), top-k."""
FC1 = "layer.experts.fc1_weight"
MOMENTS = ("exp_avg", "exp_avg_sq")


class OneMoE(nn.Module):
    """One swiglu MoE layer (gated fc1)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = MoELayer(MoEConfig(H, F, E, top_k=TOP_K))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def old_checkpoint() -> tuple[dict, dict]:
    """(weights, AdamW state by parameter name) in the older layout, away from the initial values."""
    gen = torch.Generator().manual_seed(7)
    weights = {}
    for key, value in OneMoE().state_dict().items():
        value = value.flatten(1, 2) if key == FC1 else value  # [E, 2, F, H] -> the older [E, 2F, H]
        weights[key] = value + torch.randn(value.shape, generator=gen)
    optim = {
        name: {"step": torch.tensor(3.0), **{m: torch.rand(p.shape, generator=gen) for m in MOMENTS}}
        for name, p in OneMoE().named_parameters()
    }
    return weights, optim


def new_layout(key: str, value: torch.Tensor) -> torch.Tensor:
    """The oracle: the older fc1 is the gate rows then the up rows, so the new one is a reshape."""
    return value.view(E, 2, F, H) if key.endswith("fc1_weight") else value


def stored_slice(key: str, full: torch.Tensor, ctx) -> torch.Tensor:
    """This rank's stored block of an older-layout global tensor: its experts, its F block of the
    gate rows then of the up rows (fc1), of the columns (fc2)."""
    if ".experts." not in key:
        return full
    nle, block = E // ctx.size("ep"), F // ctx.size("etp")
    experts = full[ctx.rank_in("ep") * nle : (ctx.rank_in("ep") + 1) * nle]
    f0 = ctx.rank_in("etp") * block
    if key.endswith("fc1_weight"):
        return torch.cat([experts[:, f0 : f0 + block], experts[:, F + f0 : F + f0 + block]], dim=1)
    return experts[:, :, f0 : f0 + block] if key.endswith("fc2_weight") else experts


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered over its mesh (under FULL_SHARD an expert parameter's mesh is EDP only)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _load_old(rank: int, world_size: int, folder: str, weights: dict, optim: dict) -> str:
    for layout, sharding in (({"etp": 2}, "NO_SHARD"), ({"ep": 2}, "NO_SHARD"), ({}, "FULL_SHARD")):
        ctx = build_parallel_context(ParallelDims(world_size, **layout), "cpu")
        converter = ExpertStateConverter(ctx)
        model = parallelize(OneMoE(), ctx, sharding_strategy=sharding)
        optimizer = torch.optim.AdamW(model.parameters())
        init_optimizer_state(optimizer)
        templates = {"state_dict": model.state_dict(), "optimizer_0": optimizer_state_dict(model, optimizer, converter)}
        # What MoEStrategy does: adopt the older layout, check the entries, load.
        metadata = read_dcp_metadata(f"{folder}/.metadata")
        assert sorted(adopt_legacy_fc1(templates, metadata)) == [
            f"optimizer_0.{FC1}.exp_avg", f"optimizer_0.{FC1}.exp_avg_sq", f"state_dict.{FC1}"]
        check_entries(metadata, expected_entries(templates), folder, "state_dict.")
        load_sharded(templates, folder, metadata=metadata)
        model.load_state_dict(templates["state_dict"])
        load_optimizer_state_dict(model, optimizer, templates["optimizer_0"], None, converter)
        for name, param in model.named_parameters():
            assert torch.equal(_whole(param.detach()), stored_slice(name, weights[name], ctx)), (layout, name)
            for m in MOMENTS:
                assert torch.equal(_whole(optimizer.state[param][m]), stored_slice(name, optim[name][m], ctx)), (layout, name, m)
        for key, value in model.state_dict().items():
            assert torch.equal(_whole(value), new_layout(key, weights[key])), (layout, key)
        # A single-file state dict of the older layout, loaded as MoEStrategy loads a consolidated file.
        fresh = parallelize(OneMoE(), ctx, sharding_strategy=sharding)
        fresh.load_state_dict(distribute_full_tensors(fresh, {k: v.clone() for k, v in weights.items()}))
        for name, param in fresh.named_parameters():
            assert torch.equal(_whole(param.detach()), stored_slice(name, weights[name], ctx)), (layout, "file", name)
    wrong = {**weights, FC1: torch.zeros(E, 2, F + 2, H)}
    with pytest.raises(ValueError, match=rf"{FC1}: expected the global shape \(4, 2, 8, 16\) or the older \(4, 16, 16\).*got \(4, 2, 10, 16\)"):
        fresh.load_state_dict(distribute_full_tensors(fresh, wrong))
    return "ok"


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_older_fc1_layout_loads_on_one_device_and_sharded(tmp_path):
    """Written in the older layout (DCP folder with AdamW moments; one file); loaded on one device
    (both) and on 2 ranks at ETP=2, at EP=2 and under FULL_SHARD (both): exactly the saved values,
    each rank its slice. An fc1 of neither shape is refused naming both."""
    weights, optim = old_checkpoint()
    folder = str(tmp_path / "old_dcp")
    assert not dist.is_initialized()
    dcp.save({"state_dict": weights, "optimizer_0": optim}, checkpoint_id=folder)
    file = tmp_path / "old.pt"
    torch.save(weights, file)

    one = OneMoE()
    one.load_state_dict(torch.load(file, weights_only=True))
    assert one.state_dict().keys() == weights.keys()
    for key, value in one.state_dict().items():
        assert torch.equal(value, new_layout(key, weights[key])), key
    two = OneMoE()
    state = {"state_dict": two.state_dict()}
    load_sharded(state, folder)
    two.load_state_dict(state["state_dict"])
    for key, value in two.state_dict().items():
        assert torch.equal(value, new_layout(key, weights[key])), key

    assert run_distributed(_load_old, 2, folder, weights, optim, tmp_dir=tmp_path) == ["ok"] * 2
