"""Failures surface: non-finite gradients, a stopped rank, anomaly mode with tensor parallelism.

* A NaN in one rank's MoE input spreads to every gradient through the reductions. The strategy
  refuses the step (or skips it, on request) before the optimizer runs; the oracle is the rule:
  the weights stay those of the last good step, finite, on every rank.
* A rank that stops (SIGSTOP) makes the others fail within the strategy's ``timeout`` (every
  subgroup gets it), not torch's 30-minute default.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers.dist import DistributedTestError, run_distributed
from lightning.pytorch.callbacks import Callback
from strategies.toy import ToyModule, make_dataset, quiet_trainer_kwargs, train_loader

from lightning_moe.strategies import MoEStrategy
from lightning_moe.strategies.optimizer_step import NonFiniteGradientsError

pytestmark = pytest.mark.distributed

STEPS = 3


class NaNInputOnRankZero(Callback):
    """Rank 0's input holds one NaN at step 1; records the dense weights after every step."""

    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if dist.get_rank() == 0 and trainer.global_step == 1:
            batch[0][0, 0, 0] = float("nan")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.weights.append(pl_module.net.head.weight.detach().clone())


def _fit_with_nan(rank: int, world: int, policy: str) -> dict:
    probe, module = NaNInputOnRankZero(), ToyModule()
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=world, strategy=MoEStrategy(expert_parallel_size=2, on_nonfinite_grads=policy),
        max_steps=STEPS, callbacks=[probe],
    ))
    error = None
    try:
        trainer.fit(module, train_loader(make_dataset(32)))
    except NonFiniteGradientsError as err:
        error = str(err)
    finite = all(torch.isfinite(p).all() for p in module.parameters())
    skipped = trainer.callback_metrics.get("moe/skipped_steps")
    return {"error": error, "finite": finite, "weights": probe.weights, "global_step": trainer.global_step,
            "skipped": None if skipped is None else float(skipped)}


def test_non_finite_gradients_raise_before_the_step(tmp_path):
    for r in run_distributed(_fit_with_nan, 2, "raise", timeout_s=120, tmp_dir=tmp_path):
        assert r["error"] is not None and r["error"].startswith("Step 1: the gradients are not finite")
        assert "on_nonfinite_grads='skip'" in r["error"]
        assert r["finite"] and r["global_step"] == 1  # the weights of the last good step


def test_non_finite_gradients_can_skip_the_step(tmp_path):
    for r in run_distributed(_fit_with_nan, 2, "skip", timeout_s=120, tmp_dir=tmp_path):
        assert r["error"] is None and r["finite"] and r["global_step"] == STEPS
        torch.testing.assert_close(r["weights"][1], r["weights"][0], rtol=0, atol=0)  # step 1 changed nothing
        assert not torch.equal(r["weights"][2], r["weights"][1])  # step 2 trained again
        assert r["skipped"] == 1.0


def test_unknown_nonfinite_policy_is_refused():
    with pytest.raises(ValueError, match=r"on_nonfinite_grads='ignore'; choose one of \['raise', 'skip'\]"):
        MoEStrategy(on_nonfinite_grads="ignore")


TIMEOUT_S = 5
SLACK_S = 25  # process teardown and gloo's own polling, far below torch's 30-minute default


class StopRankOne(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if dist.get_rank() == 1 and trainer.global_step == 1:
            os.kill(os.getpid(), signal.SIGSTOP)


def _fit_with_a_stopped_rank(rank: int, world: int, report: str) -> None:
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=world, strategy=MoEStrategy(expert_parallel_size=2, timeout=timedelta(seconds=TIMEOUT_S)),
        max_steps=STEPS, callbacks=[StopRankOne()],
    ))
    start = time.monotonic()

    class Clock(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            nonlocal start
            start = time.monotonic()

    trainer.callbacks.append(Clock())
    try:
        trainer.fit(ToyModule(), train_loader(make_dataset(32)))
    except Exception as err:  # what a user's job sees: an error, then the launcher ends the others
        with open(report, "w") as f:
            json.dump({"error": f"{type(err).__name__}: {err}", "after_s": time.monotonic() - start}, f)
        raise


def test_a_stopped_rank_ends_the_job_within_the_timeout(tmp_path):
    report = str(tmp_path / "rank0.json")
    with pytest.raises(DistributedTestError):  # rank 1 stays stopped until the harness kills it
        run_distributed(_fit_with_a_stopped_rank, 2, report, timeout_s=90, tmp_dir=tmp_path)
    with open(report) as f:
        outcome = json.load(f)
    assert outcome["after_s"] < TIMEOUT_S + SLACK_S, outcome


def _fit_with_anomaly_mode(rank: int, world: int, tp: int) -> str:
    from parallel.test_batch_agreement import RankSeededTokens  # the TP-capable language-model data

    from lightning_moe import MoEConfig
    from lightning_moe.lit import MoELanguageModel
    from lightning_moe.models import MoETransformerConfig

    config = MoETransformerConfig(vocab_size=64, hidden_size=32, num_layers=1, num_attention_heads=4, num_kv_heads=2,
                                  ffn_hidden_size=64, moe=MoEConfig(32, 16, 4, top_k=2))
    strategy = MoEStrategy(tensor_parallel_size=tp, expert_parallel_size=world // tp, expert_tensor_parallel_size=1)
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=world, strategy=strategy, max_steps=2), detect_anomaly=True)
    try:
        trainer.fit(MoELanguageModel(config), torch.utils.data.DataLoader(RankSeededTokens(False), batch_size=2))
    except ValueError as err:
        return str(err)
    return f"trained {trainer.global_step} steps"


@pytest.mark.parametrize("tp", [1, 2])
def test_anomaly_mode_runs_without_tensor_parallelism_and_is_refused_with_it(tmp_path, tp):
    for outcome in run_distributed(_fit_with_anomaly_mode, 2, tp, timeout_s=120, tmp_dir=tmp_path):
        if tp == 1:
            assert outcome == "trained 2 steps"
        else:
            assert "detect_anomaly=True) does not work with tensor_parallel_size=2" in outcome


def test_clipping_reuses_the_guards_norm_unless_the_gradients_changed(monkeypatch):
    """One pass over the gradients per clipped step; a gradient changed in between is measured again."""
    from types import SimpleNamespace

    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_moe.parallel import ParallelDims, build_parallel_context
    from lightning_moe.parallel import grad_norm as grad_norm_module
    from lightning_moe.strategies import optimizer_step as step_module

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        ctx = build_parallel_context(ParallelDims(1), "cpu")
        calls = []
        measure = grad_norm_module.global_grad_norm

        def counting(params, context, norm_type=2.0):
            calls.append(1)
            return measure(params, context, norm_type)

        monkeypatch.setattr(step_module, "global_grad_norm", counting)
        monkeypatch.setattr(grad_norm_module, "global_grad_norm", counting)
        layer = torch.nn.Linear(4, 3)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        guard, plugin = step_module.GradientGuard(), SimpleNamespace()
        step_module.patch_gradient_clipping(plugin, lambda: ctx, lambda: None, guard)
        for changed_in_between in (False, True):
            layer.zero_grad()
            layer(torch.randn(5, 4, generator=torch.Generator().manual_seed(3))).square().sum().backward()
            calls.clear()
            assert guard.check(optimizer, ctx, step=0)
            if changed_in_between:
                layer.weight.grad.mul_(3.0)  # e.g. a callback's on_before_optimizer_step
            want = [p.grad.clone() for p in layer.parameters()]
            norm = torch.linalg.vector_norm(torch.cat([w.flatten() for w in want]))
            expected = [w * min(1.0, 1.0 / (norm.item() + 1e-6)) for w in want]
            plugin.clip_grad_by_norm(optimizer, 1.0)
            assert len(calls) == (2 if changed_in_between else 1)
            for got, wanted in zip((p.grad for p in layer.parameters()), expected):
                torch.testing.assert_close(got, wanted)
    finally:
        dist.destroy_process_group()


def _fit_after_a_slow_start(rank: int, world: int, port: int, timeout_s: float) -> float | None:
    """Leave the harness's group, then start as a launched rank does: rank 1 joins 3 s late (imports)."""
    dist.destroy_process_group()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(world))
    if rank == 1:
        time.sleep(3 * timeout_s)
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=world, strategy=MoEStrategy(expert_parallel_size=2, timeout=timedelta(seconds=timeout_s)), max_steps=1,
    ))
    trainer.fit(ToyModule(), train_loader(make_dataset(8)))
    group = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return group.options._timeout.total_seconds()


def test_a_slow_start_is_not_limited_by_the_collective_timeout(tmp_path):
    import socket

    with socket.socket() as probe:  # a free port for the ranks' own TCP rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    timeouts = run_distributed(_fit_after_a_slow_start, 2, port, 1.0, timeout_s=120, tmp_dir=tmp_path)
    assert timeouts == [1.0, 1.0]  # collectives keep the strategy's timeout


def test_an_allocation_that_fails_while_loading_names_the_checkpoint(tmp_path, monkeypatch):
    """A checkpoint whose sizes ask for more memory than there is (a damaged or crafted one) names its path."""
    strategy, where = MoEStrategy(), tmp_path / "epoch=0.ckpt"
    allocator = "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried to allocate 85899345920 bytes."

    def load(path, weights_only=None):
        raise RuntimeError(allocator)

    monkeypatch.setattr(strategy.checkpointing, "load", load)
    with pytest.raises(MemoryError, match=rf"Loading the checkpoint {where} needs more memory than this rank can "
                                          r"allocate \(RuntimeError: .*85899345920 bytes"):
        strategy.load_checkpoint(where)
