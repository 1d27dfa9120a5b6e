"""``state_dict()`` at scale is local: no collective, no new storage, only views of the held shards.

Mixtral-8x7B at world 64, TP=8 with EP=8, ETP=1 and with EP=4, ETP=2 (a gated fc1 split over
ETP), plain and under FSDP2 ``FULL_SHARD``, one fake rank: the model's ``state_dict()`` and the
sharded optimizer state (AdamW moments of the experts, as ``MoEStrategy`` saves them) are
audited op by op (`scale.dispatch_audit.DispatchAudit`). A
collective there would make a checkpoint hang when one rank calls it alone; new storage would be a
gather or a copy of the experts at checkpoint time. The oracle for the format is the single-device
model of the same preset: the same keys with the same global shapes.
"""

from __future__ import annotations

import pytest
import torch
from scale.dispatch_audit import DispatchAudit, storage_key
from scale.fake_world import sharded_preset
from torch.distributed.tensor import DTensor

from lightning_moe.checkpoint.sharded import optimizer_state_dict
from lightning_moe.models import MoETransformer
from lightning_moe.parallel import ParallelDims
from lightning_moe.parallel.expert_parallel import ExpertStateConverter
from lightning_moe.planning.fake_world import fake_rank

NAME = "mixtral_8x7b"
ETP1 = ParallelDims(world_size=64, tp=8, ep=8, etp=1)
ETP2 = ParallelDims(world_size=64, tp=8, ep=4, etp=2)
CASES = [(ETP1, "NO_SHARD"), (ETP2, "NO_SHARD"), (ETP2, "FULL_SHARD")]
RANK = 3


def _expert(key: str) -> bool:
    return ".experts." in key


@pytest.mark.parametrize(("dims", "sharding"), CASES, ids=["etp1", "etp2", "etp2-full-shard"])
def test_state_dicts_are_views_of_the_held_shards_without_collectives(dims, sharding):
    """Model and optimizer state dicts: no collective, no new storage, every expert entry a DTensor
    whose local tensor shares a held shard's storage; keys and global shapes those of one device."""
    with fake_rank(RANK, dims.world_size):
        sharded = sharded_preset(NAME, dims, RANK, sharding)
        model = sharded.model
        experts = [p for n, p in model.named_parameters() if _expert(n)]
        optimizer = torch.optim.AdamW(experts)
        for p in experts:  # AdamW's state after a step, without running one
            optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}
        moments = [v for state in optimizer.state.values() for v in state.values()]
        held = {storage_key(t) for t in [*model.parameters(), *model.buffers(), *moments]}
        converter = ExpertStateConverter(sharded.ctx)  # slicing the expert mesh makes small index tensors
        with DispatchAudit(held) as audit:
            state = model.state_dict()
            optim = optimizer_state_dict(model, optimizer, converter)
        assert audit.collectives == [], f"state_dict() ran collectives: {audit.collectives[:4]}"
        assert audit.new_storages == 0, f"state_dict() allocated {audit.peak_bytes / 2**30:.2f} GiB"
        entries = [(k, v) for k, v in state.items() if _expert(k)]
        entries += [(f"{k}/{m}", v) for k, s in optim.items() for m, v in s.items() if m != "step"]
        assert len(entries) == 3 * len(experts)
        for key, value in entries:
            assert isinstance(value, DTensor), key
            assert storage_key(value) in held, f"{key} is not a view of a held shard"
        optim_shapes = {k: tuple(s["exp_avg"].shape) for k, s in optim.items()}
    with torch.device("meta"):
        one_device = MoETransformer(sharded.config).state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in one_device.items()}
    assert optim_shapes == {k: tuple(one_device[k].shape) for k in optim_shapes}
