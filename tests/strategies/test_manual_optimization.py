"""Manual optimization under MoEStrategy: several ``manual_backward`` calls, one step.

The strategy reduces the accumulated gradients once, right before ``optimizer.step()`` (not after
each backward), so two half-batch backward passes equal one full-batch step of the
single-process oracle.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from strategies.toy import (
    ToyModule,
    full_tensors,
    loss_fn,
    make_dataset,
    quiet_trainer_kwargs,
    reference_run,
    train_loader,
)

from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

STEPS = 3
NUM_SAMPLES = 32
PARAM_TOL = 1e-5  # fp32 AdamW steps after reductions in another order than one process


class ManualToy(ToyModule):
    """Each step: two half micro-batches, ``manual_backward`` on each half's loss / 2, then step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y, _ = batch
        for half in (slice(0, 1), slice(1, 2)):
            self.manual_backward(loss_fn(self.net(x[half]), y[half]) / 2)
        optimizer.step()
        optimizer.zero_grad()


def _manual_fit(rank: int, world: int, ep: int) -> dict:
    model = ManualToy()
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=world, strategy=MoEStrategy(expert_parallel_size=ep), max_steps=STEPS))
    trainer.fit(model, train_loader(make_dataset(NUM_SAMPLES)))
    return full_tensors(model.net, dict(model.net.named_parameters()))


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_two_manual_backward_passes_reduce_once(ep, tmp_path):
    want = reference_run(make_dataset(NUM_SAMPLES), STEPS).params
    for rank, params in enumerate(run_distributed(_manual_fit, 4, ep, timeout_s=120, tmp_dir=tmp_path)):
        for name, value in want.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=PARAM_TOL, msg=f"rank {rank} {name}")
