"""`PipelineRunner`'s schedule cache and its shape probe, on 2 forked gloo ranks (PP=2).

Cache: batches of many distinct sizes, trained and evaluated, leave at most
``SCHEDULES_KEPT`` schedules per mode cached, and every dropped schedule's stages (with their
receive buffers) are unreachable after garbage collection (weak references to them are dead).
Probe: the boundary shapes it gives every stage are the shapes the schedule then really sends
(oracle: forward pre-hooks on the stage modules during an evaluation), and it runs no MoE layer of
a later stage (those would route synthetic hidden states, all to the same experts).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers.dist import run_distributed

from lightning_moe import MoEConfig
from lightning_moe.layers.loss_scale import set_aux_loss_scale
from lightning_moe.layers.moe import MoELayer
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.models.transformer import next_token_loss
from lightning_moe.parallel import ParallelDims, build_parallel_context
from lightning_moe.parallel.grad_sync import GradSync
from lightning_moe.parallel.pipeline.runner import SCHEDULES_KEPT, PipelineRunner

M, SEQ = 2, 4
SIZES = [4, 2, 6, 8, 4, 10]  # batch sizes, each a multiple of M


def _model() -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(MoETransformerConfig(
        vocab_size=32, hidden_size=16, num_layers=4, num_attention_heads=2, num_kv_heads=1, ffn_hidden_size=32,
        first_dense_layers=1, max_seq_len=SEQ, moe=MoEConfig(16, 8, 4, top_k=2),
    ))


def _tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 32, (n, SEQ + 1), generator=torch.Generator().manual_seed(n))
    return tokens[:, :-1], tokens[:, 1:]


def _stages_of(schedule) -> list:
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def _run(rank: int, world_size: int) -> dict:
    ctx = build_parallel_context(ParallelDims(world_size, pp=2), "cpu")
    model = _model()
    runner = PipelineRunner(model, ctx, "1F1B", M, next_token_loss, torch.device("cpu"))
    sync = GradSync(model, ctx, explicit_backward=True)
    set_aux_loss_scale(model, 1.0)
    later = [m for module, s in zip(runner.modules, runner.stage_ids) if s > 0
             for m in module.modules() if isinstance(m, MoELayer)]
    calls = []
    handles = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for m in later]
    inputs, targets = _tokens(SIZES[0])
    metas = runner._stage_metas(inputs)
    probe_moe_calls = len(calls)
    for h in handles:
        h.remove()
    sent: dict[int, tuple] = {}

    def record(s):
        def hook(_module, args):
            sent.setdefault(s, (tuple(args[0].shape), args[0].dtype))
        return hook

    hooks = [module.register_forward_pre_hook(record(s)) for module, s in zip(runner.modules, runner.stage_ids)]
    runner.eval(inputs, targets)
    for h in hooks:
        h.remove()
    refs, cached = [], []
    for n in SIZES:
        inputs, targets = _tokens(n)
        model.zero_grad(set_to_none=True)
        runner.step(inputs, targets, sync)
        runner.eval(inputs, targets)
        refs += [weakref.ref(st) for schedule in runner._schedules.values() for st in _stages_of(schedule)]
        cached.append(len(runner._schedules))
    gc.collect()
    kept = {id(st) for schedule in runner._schedules.values() for st in _stages_of(schedule)}
    alive = {id(r()) for r in refs if r() is not None}
    return {"probe_moe_calls": probe_moe_calls, "later_moe_layers": len(later), "metas": metas, "sent": sent,
            "stages": runner.stage_ids, "cached": cached, "dropped_alive": len(alive - kept), "kept": len(kept)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_run, 2, timeout_s=240, tmp_dir=tmp_path_factory.mktemp("pipeline_schedules"))


@pytest.mark.distributed
def test_schedule_cache_is_bounded_and_dropped_stages_are_freed(runs):
    for rank, result in enumerate(runs):
        assert max(result["cached"]) <= 2 * SCHEDULES_KEPT, (rank, result["cached"])
        assert result["dropped_alive"] == 0, f"rank {rank}: {result['dropped_alive']} dropped stages still referenced"


@pytest.mark.distributed
def test_probe_runs_no_later_moe_layer_and_gives_the_sent_shapes(runs):
    for rank, result in enumerate(runs):
        assert result["later_moe_layers"] > 0 or rank == 0
        assert result["probe_moe_calls"] == 0, f"rank {rank}: the probe ran {result['probe_moe_calls']} MoE layers"
        for s, shape in result["sent"].items():
            assert tuple(result["metas"][s][0]) == shape[0] and result["metas"][s][1] == shape[1], (rank, s)
