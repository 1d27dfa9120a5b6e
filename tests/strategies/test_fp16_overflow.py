"""16-mixed under expert parallelism: an overflow in one rank's experts skips the step on every rank.

The GradScaler decides from the gradients its rank holds; with experts sharded over EP they
differ per rank. 2 gloo ranks at EP=2, fp16 autocast on CPU with a CPU GradScaler; on the first
step rank 0's expert gradient is made infinite. Oracle: the rule itself. Every rank skips that
step (dense parameters unchanged, scale halved), and the replicated dense parameters stay
identical across ranks for the rest of the run.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from strategies.toy import ToyModule, make_dataset, quiet_trainer_kwargs, train_loader

from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

INIT_SCALE = 2.0**8  # small enough that nothing but the injected inf overflows


class OverflowOnRankZero(Callback):
    """Multiplies rank 0's expert gradient by inf during the first step; records dense weights."""

    def __init__(self) -> None:
        self.dense_after: list[torch.Tensor] = []
        self.scales: list[float] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.initial = pl_module.net.head.weight.detach().clone()
        rank = dist.get_rank()

        def poison(grad):
            return grad * float("inf") if rank == 0 and trainer.global_step == 0 else grad

        pl_module.net.moe1.experts.fc1_weight.register_hook(poison)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.dense_after.append(pl_module.net.head.weight.detach().clone())
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def _run(rank: int, world: int) -> dict:
    probe = OverflowOnRankZero()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=world, strategy=MoEStrategy(expert_parallel_size=2), plugins=[plugin], max_steps=3,
        callbacks=[probe],
    ))
    module = ToyModule()
    trainer.fit(module, train_loader(make_dataset(32)))
    return {"initial": probe.initial, "dense": probe.dense_after, "scales": probe.scales}


def test_an_overflow_on_one_rank_skips_the_step_everywhere(tmp_path):
    ranks = run_distributed(_run, 2, timeout_s=120, tmp_dir=tmp_path)
    for r in ranks:
        assert r["scales"] == [INIT_SCALE / 2, INIT_SCALE / 2, INIT_SCALE / 2]
        torch.testing.assert_close(r["dense"][0], r["initial"], rtol=0, atol=0)  # step 1 skipped
        assert not torch.equal(r["dense"][2], r["initial"])  # later steps were taken
    for step in range(3):
        torch.testing.assert_close(ranks[0]["dense"][step], ranks[1]["dense"][step], rtol=0, atol=0)
