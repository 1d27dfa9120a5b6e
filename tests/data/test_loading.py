"""`ResumableLoader` resumes an epoch after any batch; `eval_loader` deals every item once.

Oracles: the uninterrupted iteration of the same loader (its batches from the resume point on),
torch's ``DistributedSampler`` (the training order is its order), and the dataset's own items
(each real item once over all replicas, padding rows without any target).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from lightning_moe.data.loading import ResumableLoader, ResumableSampler, eval_loader

SAMPLES, BATCH = 13, 2


def _dataset() -> TensorDataset:
    ids = torch.arange(SAMPLES)
    return TensorDataset(ids[:, None].repeat(1, 3), ids[:, None].repeat(1, 3))


def _loader(replicas: int = 2, rank: int = 1, batch: int = BATCH, seed: int = 4) -> ResumableLoader:
    data = _dataset()
    sampler = ResumableSampler(data, num_replicas=replicas, rank=rank, seed=seed)
    return ResumableLoader(data, sampler=sampler, batch_size=batch, drop_last=True)


def _epoch(loader: ResumableLoader, epoch: int) -> list[list[int]]:
    loader.sampler.set_epoch(epoch)
    return [batch[0][:, 0].tolist() for batch in loader]


def test_training_order_is_the_distributed_samplers():
    want = list(DistributedSampler(range(SAMPLES), num_replicas=2, rank=1, shuffle=True, seed=4))
    assert [i for batch in _epoch(_loader(), 0) for i in batch] == want[: len(want) // BATCH * BATCH]


@pytest.mark.parametrize("epoch", [0, 1])
def test_resume_after_any_batch_yields_exactly_the_rest(epoch):
    loader = _loader()
    full = _epoch(loader, epoch)
    assert len(full) == len(loader) == 3
    for stop in range(len(full) + 1):
        loader.sampler.set_epoch(epoch)
        iterator = iter(loader)
        for _ in range(stop):
            next(iterator)
        state = loader.state_dict()
        assert (state["epoch"], state["batches"]) == (epoch, stop)
        resumed = _loader()
        resumed.load_state_dict(state)
        assert _epoch(resumed, epoch) == full[stop:], stop
        assert _epoch(resumed, epoch) == full, "the skip applies to the resumed epoch's iteration only"


def test_a_restored_state_of_another_epoch_skips_nothing():
    resumed = _loader()
    resumed.load_state_dict({**_loader().state_dict(), "epoch": 0, "batches": 3})  # saved at epoch 0's end
    assert _epoch(resumed, 1) == _epoch(_loader(), 1)


def test_resuming_with_another_layout_warns():
    state = _loader().state_dict()
    with pytest.warns(UserWarning, match=r"another data layout \(num_replicas 2 -> 4, batch_size 2 -> 1\)"):
        _loader(replicas=4, batch=1).load_state_dict(state)


@pytest.mark.parametrize("replicas", [1, 3, 4])
def test_eval_loader_deals_every_item_once_in_full_batches(replicas):
    data = _dataset()
    seen, batches = [], set()
    for rank in range(replicas):
        loader = eval_loader(data, BATCH, replicas, rank)
        batches.add(len(loader))
        for inputs, targets in loader:
            assert inputs.shape == (BATCH, 3)
            real = targets[:, 0] != -100
            assert (targets[~real] == -100).all() and (inputs[~real] == 0).all()
            seen += targets[real, 0].tolist()
    assert sorted(seen) == list(range(SAMPLES))
    assert len(batches) == 1, f"ranks run different numbers of batches: {batches}"
