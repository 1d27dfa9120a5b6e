"""Pipeline parallelism folded with EP and TP, and checkpoints across pipeline layouts.

Folds. Oracle: the matching PP=1 run on 2 ranks (same DP, EP, TP) with ``accumulate_grad_batches=M``
on micro-batches of ``B / M`` (itself checked against one process by ``test_fit_parity.py``). On 4
forked gloo ranks, PP=2 x EP=2 and PP=2 x TP=2 (ETP=1, EP=2) with 1F1B and ``M=4`` must give the
same loss per step on every data-parallel replica and the same parameters after 3 AdamW steps
(aux loss, z loss, expert bias and clipping on).

Resume. Oracle: the weights the saving run held. A PP=2 checkpoint loaded at PP=1, and a PP=1
checkpoint loaded at PP=2, must give bitwise the same weights (each PP=2 rank: its stages' keys).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from strategies.test_pipeline_parity import CLIP, Measure, dataset, model_config
from strategies.toy import quiet_trainer_kwargs
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_moe.lit import MoELanguageModel
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

STEPS, M, BATCH = 3, 4, 8
FOLDS = {"ep2": {"expert_parallel_size": 2}, "tp2-ep2": {"tensor_parallel_size": 2, "expert_parallel_size": 2,
                                                          "expert_tensor_parallel_size": 1}}


def _full(module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in module.state_dict().items()}


def _fit(strategy: MoEStrategy, devices: int, batch_size: int, accumulate: int, steps: int = STEPS,
         ckpt_path=None) -> tuple[dict, L.Trainer, MoELanguageModel]:
    torch.manual_seed(0)
    module = MoELanguageModel(model_config(), learning_rate=1e-2, warmup_steps=0)
    measure = Measure(accumulate)
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=devices, strategy=strategy, max_steps=steps, callbacks=[measure], accumulate_grad_batches=accumulate,
        gradient_clip_val=CLIP, limit_val_batches=0,
    ))
    trainer.fit(module, DataLoader(dataset(2 * STEPS * BATCH), batch_size=batch_size), ckpt_path=ckpt_path)
    losses = torch.tensor(measure.losses).reshape(-1, accumulate).mean(1) if measure.losses else torch.zeros(0)
    result = {"losses": losses, "state": _full(module), "dp_rank": strategy.parallel_context.rank_in("dp")}
    return result, trainer, module


def _references(rank: int, world_size: int) -> dict:
    return {name: _fit(MoEStrategy(**sizes), 2, BATCH // M, M)[0] for name, sizes in FOLDS.items()}


def _folds_and_resume(rank: int, world_size: int, tmp: str) -> dict:
    out = {name: _fit(MoEStrategy(pipeline_parallel_size=2, num_microbatches=M, **sizes), 4, BATCH, 1)[0]
           for name, sizes in FOLDS.items()}
    # PP=2 -> PP=1 (DP=4 here): one step at PP=2, saved, loaded into a fresh PP=1 module.
    saved, trainer, _ = _fit(MoEStrategy(pipeline_parallel_size=2, num_microbatches=M), 4, BATCH, 1, steps=1)
    trainer.save_checkpoint(f"{tmp}/pp2.ckpt")
    out["pp2_saved"] = saved["state"]
    out["pp1_loaded"] = _fit(MoEStrategy(), 4, BATCH, 1, steps=1, ckpt_path=f"{tmp}/pp2.ckpt")[0]["state"]
    # PP=1 -> PP=2.
    saved, trainer, _ = _fit(MoEStrategy(), 4, BATCH, 1, steps=1)
    trainer.save_checkpoint(f"{tmp}/pp1.ckpt")
    out["pp1_saved"] = saved["state"]
    try:
        out["pp2_loaded"] = _fit(MoEStrategy(pipeline_parallel_size=2, num_microbatches=M), 4, BATCH, 1, steps=1,
                                 ckpt_path=f"{tmp}/pp1.ckpt")[0]["state"]
    except ValueError as err:  # see test_resume_pp1_to_pp2_is_bitwise
        out["pp2_loaded"] = err
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_folds")
    references = run_distributed(_references, 2, timeout_s=240, tmp_dir=tmp)
    ranks = run_distributed(_folds_and_resume, 4, str(tmp), timeout_s=420, tmp_dir=tmp)
    return references, ranks


@pytest.mark.parametrize("fold", list(FOLDS))
def test_fold_equals_pp1(runs, fold):
    references, ranks = runs
    want_by_dp = {r[fold]["dp_rank"]: r[fold] for r in references}
    merged: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(ranks):
        got = result[fold]
        want = want_by_dp[got["dp_rank"]]
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, r=rank: f"rank {r} losses: {m}")
        merged.update(got["state"])
    want_state = references[0][fold]["state"]
    assert merged.keys() == want_state.keys()
    for name, value in want_state.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_resume_pp2_to_pp1_is_bitwise(runs):
    ranks = runs[1]
    saved: dict[str, torch.Tensor] = {}
    for result in ranks:
        saved.update(result["pp2_saved"])
    for rank, result in enumerate(ranks):
        loaded = result["pp1_loaded"]
        assert loaded.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), (rank, name)


def test_resume_pp1_to_pp2_is_bitwise(runs):
    ranks = runs[1]
    for result in ranks:
        if isinstance(result["pp2_loaded"], Exception):
            raise result["pp2_loaded"]
    saved = ranks[0]["pp1_saved"]
    covered: set[str] = set()
    for rank, result in enumerate(ranks):
        for name, value in result["pp2_loaded"].items():
            assert torch.equal(value, saved[name]), (rank, name)
        covered |= result["pp2_loaded"].keys()
    assert covered == saved.keys()
