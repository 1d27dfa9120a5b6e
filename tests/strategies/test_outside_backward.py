"""A backward run outside Lightning's training backward (here: by a callback, on rank 0 only)
neither launches gradient reductions nor leaks into the next step's.

Oracle: the single-process run of `strategies.toy.reference_run`; the callback's extra backward
happens after an optimizer step, and Lightning zeroes the gradients before the next one, so the
trained weights must equal the reference exactly as without it. Before the fix the hooks reacted
to it, launching all-reduces on rank 0 alone.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback
from strategies.toy import DP, ToyModule, make_dataset, quiet_trainer_kwargs, reference_run, train_loader

from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

STEPS, NUM_SAMPLES = 3, DP * 2 * 3


class BackwardOnRankZero(Callback):
    """After the first step, rank 0 alone runs a backward of its own (a gradient probe, say).

    Through the input layer only (a forward through the MoE layers is itself collective, EP): its
    gradients are the last of a training backward, so a stale "ready" mark would let their bucket
    be reduced before they arrive.
    """

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if dist.get_rank() == 0 and trainer.global_step == 1:
            layer = pl_module.net.inp
            with torch.enable_grad():
                layer(torch.randn(3, layer.in_features)).square().mean().backward()


def _fit(rank: int, world: int) -> dict:
    module = ToyModule()
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=world, strategy=MoEStrategy(expert_parallel_size=2), max_steps=STEPS,
        callbacks=[BackwardOnRankZero()],
    ))
    trainer.fit(module, train_loader(make_dataset(NUM_SAMPLES)))
    state = module.state_dict()
    return {k.removeprefix("net."): v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
            for k, v in state.items() if k.startswith("net.")}


def test_a_callback_backward_does_not_disturb_training(tmp_path):
    ranks = run_distributed(_fit, DP, timeout_s=120, tmp_dir=tmp_path)
    reference = reference_run(make_dataset(NUM_SAMPLES), STEPS).state
    for params in ranks:
        for name, want in reference.items():
            torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
