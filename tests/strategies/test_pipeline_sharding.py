"""Pipeline parallelism x sharded data parallelism (FSDP2): PP=2 x DP=2 sharded equals PP=2 x DP=2 replicated.

Oracle: the same PP=2 x DP=2 run with ``sharding_strategy="NO_SHARD"`` (itself checked against
gradient accumulation on one process by ``test_pipeline_parity.py`` and against PP=1 folds by
``test_pipeline_folds.py``). On 4 forked gloo ranks, with ``FULL_SHARD`` and ``SHARD_GRAD_OP``,
1F1B and Interleaved1F1B (two stages per rank), ``num_microbatches=4``: the loss of every step,
the validation loss and every parameter and expert bias after 3 AdamW steps must match at fp32
tolerance, with aux loss, z loss, expert bias and clipping on (experts sharded over EDP=2, the
rest over DP=2, each rank holding only its stages' parameters). Each stage module is the one FSDP2
root of its units. By default each FSDP2 unit reduce-scatters once per micro-batch (no unsharded
gradient outlives a micro-batch's backward); with ``defer_gradient_reduction=True`` (1F1B,
FULL_SHARD) once per step, with the same results.

Resume. Oracle: the weights the saving run held. A PP=2 x FULL_SHARD checkpoint loaded at PP=1 x
NO_SHARD, and a PP=1 checkpoint loaded at PP=2 x FULL_SHARD, give bitwise the same weights.

PP=2 x TP=2 (EP=2, ETP=1, DP=1) with FULL_SHARD equals the same run with NO_SHARD (the
tensor-parallel-partial gradients of the trimmed, sharded stages are summed over tp).

Meta device: a model built on the meta device trains as the materialised one. Each rank gives
storage only to its own stages (materialised after the trim, before the sharding): the
parameters that the materialisation allocates are exactly the rank's stages', fewer than the model's.
"""

from __future__ import annotations

from unittest import mock

import lightning as L
import pytest
import torch
from helpers.asserts import assert_states_close
from helpers.dist import run_distributed
from helpers.fsdp import root_states
from lightning.pytorch.callbacks import Callback
from strategies.test_pipeline_parity import CLIP, Measure, dataset, model_config
from strategies.toy import quiet_trainer_kwargs
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_moe.lit import MoELanguageModel
from lightning_moe.strategies import MoEStrategy, model_setup

pytestmark = pytest.mark.distributed

STEPS, M, BATCH = 3, 4, 8
RUNS = [("1F1B", "NO_SHARD"), ("1F1B", "FULL_SHARD"), ("1F1B", "SHARD_GRAD_OP"),
        ("Interleaved1F1B", "NO_SHARD"), ("Interleaved1F1B", "FULL_SHARD")]
TP2 = {"tensor_parallel_size": 2, "expert_parallel_size": 2, "expert_tensor_parallel_size": 1}


class CountReductions(Callback):
    """FSDP2 reduce-scatters (``foreach_reduce`` calls) of each training step."""

    def __init__(self) -> None:
        self.calls, self.per_step = 0, []
        self._reduce = _fsdp_param_group.foreach_reduce

    def counted(self, *args, **kwargs):
        self.calls += 1
        return self._reduce(*args, **kwargs)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.calls = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.per_step.append(self.calls)


def _fit(schedule: str, sharding: str, pp: int = 2, steps: int = STEPS, ckpt_path=None,
         meta: bool = False, **sizes) -> tuple[dict, L.Trainer]:
    torch.manual_seed(0)
    module = MoELanguageModel(model_config(), learning_rate=1e-2, warmup_steps=0)
    if meta:  # materialised by the strategy, before the trim
        with torch.device("meta"):
            module.configure_model()
    measure, count = Measure(1), CountReductions()
    materialised: list[int] = []  # meta parameters given storage by each materialisation of the whole module
    materialize = model_setup.materialize

    def counting_materialize(model, *args, **kwargs):
        meta = sum(p.numel() for p in model.parameters() if p.is_meta)
        if isinstance(model, L.LightningModule) and meta:
            materialised.append(meta)
        return materialize(model, *args, **kwargs)

    strategy = MoEStrategy(pipeline_parallel_size=pp, pipeline_schedule=schedule, num_microbatches=M if pp > 1 else None,
                           sharding_strategy=sharding, **sizes)
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=4, strategy=strategy, max_steps=steps, callbacks=[measure, count], gradient_clip_val=CLIP,
        limit_val_batches=1,
    ))
    with mock.patch.object(_fsdp_param_group, "foreach_reduce", count.counted), \
            mock.patch.object(model_setup, "materialize", counting_materialize):
        trainer.fit(module, DataLoader(dataset(2 * STEPS * BATCH), batch_size=BATCH),
                    DataLoader(dataset(2 * BATCH), batch_size=BATCH), ckpt_path=ckpt_path)
    stages = strategy.pipeline_stages
    return {
        "losses": torch.tensor(measure.losses), "val_loss": trainer.callback_metrics.get("val_loss"),
        "units": sum(isinstance(m, FSDPModule) for m in module.modules()), "reductions": count.per_step,
        "stage roots": [isinstance(s, FSDPModule) and s._get_fsdp_state()._is_root for s in stages],
        "roots": len(root_states([module, *stages])),
        "materialised": materialised, "params": sum(p.numel() for p in module.parameters()),  # global shapes
        "state": {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                  for k, v in module.state_dict().items()},
    }, trainer


def _runs(rank: int, world_size: int, tmp: str) -> dict:
    out = {}
    for run in RUNS:
        out[run], trainer = _fit(*run)
        if run == ("1F1B", "FULL_SHARD"):
            trainer.save_checkpoint(f"{tmp}/pp2_full_shard.ckpt")
    out["meta"] = _fit("1F1B", "FULL_SHARD", meta=True)[0]
    out["deferred"] = _fit("1F1B", "FULL_SHARD", defer_gradient_reduction=True)[0]
    for sharding in ("NO_SHARD", "FULL_SHARD"):  # TP=2: the router's TP-partial gradients summed over tp
        out[f"tp2 {sharding}"] = _fit("1F1B", sharding, **TP2)[0]
    # PP=2 x FULL_SHARD -> PP=1 x NO_SHARD (DP=4): loaded at the saved step, no step taken.
    out["pp1_loaded"] = _fit("1F1B", "NO_SHARD", pp=1, ckpt_path=f"{tmp}/pp2_full_shard.ckpt")[0]["state"]
    # PP=1 -> PP=2 x FULL_SHARD.
    saved, trainer = _fit("1F1B", "NO_SHARD", pp=1, steps=1)
    trainer.save_checkpoint(f"{tmp}/pp1.ckpt")
    out["pp1_saved"], out["pp1_params"] = saved["state"], saved["params"]
    out["pp2_loaded"] = _fit("1F1B", "FULL_SHARD", steps=1, ckpt_path=f"{tmp}/pp1.ckpt")[0]["state"]
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_sharding")
    return run_distributed(_runs, 4, str(tmp), timeout_s=420, tmp_dir=tmp)


@pytest.mark.parametrize("run", [r for r in RUNS if r[1] != "NO_SHARD"], ids="-".join)
def test_sharded_pipeline_equals_replicated(ranks, run):
    schedule, _ = run
    for rank, result in enumerate(ranks):
        got, want = result[run], result[(schedule, "NO_SHARD")]
        assert got["units"] > 0 and want["units"] == 0, (rank, got["units"], want["units"])
        assert len(got["losses"]) == STEPS
        assert got["reductions"] == [M * got["units"]] * STEPS, (rank, got["reductions"], got["units"])  # per micro-batch
        assert all(got["stage roots"]) and got["roots"] == len(got["stage roots"]), (rank, got["stage roots"], got["roots"])
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, r=rank: f"rank {r} losses: {m}")
        assert got["val_loss"] is not None
        torch.testing.assert_close(got["val_loss"], want["val_loss"], rtol=1e-5, atol=1e-6)
        assert_states_close(got["state"], want["state"], 1e-5, 1e-5, f"rank {rank}")


def test_deferred_reduction_reduces_once_per_step_with_the_same_results(ranks):
    for rank, result in enumerate(ranks):
        got, want = result["deferred"], result[("1F1B", "NO_SHARD")]
        assert got["reductions"] == [got["units"]] * STEPS, (rank, got["reductions"], got["units"])  # once per step
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, r=rank: f"rank {r} losses: {m}")
        assert_states_close(got["state"], want["state"], 1e-5, 1e-5, f"rank {rank}")


def test_sharded_pipeline_checkpoint_resumes_across_layouts(ranks):
    saved: dict[str, torch.Tensor] = {}
    for result in ranks:
        saved.update(result[("1F1B", "FULL_SHARD")]["state"])
    covered: set[str] = set()
    for rank, result in enumerate(ranks):
        loaded = result["pp1_loaded"]
        assert loaded.keys() == saved.keys(), rank
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), ("PP=2 FULL_SHARD -> PP=1", rank, name)
        for name, value in result["pp2_loaded"].items():
            assert torch.equal(value, result["pp1_saved"][name]), ("PP=1 -> PP=2 FULL_SHARD", rank, name)
        covered |= result["pp2_loaded"].keys()
    assert covered == ranks[0]["pp1_saved"].keys()


def test_meta_device_model_under_sharded_pipeline(ranks):
    whole = ranks[0]["pp1_params"]
    for rank, result in enumerate(ranks):
        got, want = result["meta"], result[("1F1B", "NO_SHARD")]
        # Only this rank's stages were given storage, not the whole model.
        assert got["materialised"] == [got["params"]] and got["params"] < whole, (rank, got["materialised"], whole)
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, r=rank: f"rank {r} losses: {m}")
        assert_states_close(got["state"], want["state"], 1e-5, 1e-5, f"rank {rank}")


def test_tensor_parallel_sharded_pipeline_equals_replicated(ranks):
    for rank, result in enumerate(ranks):
        got, want = result["tp2 FULL_SHARD"], result["tp2 NO_SHARD"]
        assert got["units"] > 0, rank
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, r=rank: f"rank {r} losses: {m}")
        assert_states_close(got["state"], want["state"], 1e-5, 1e-5, f"rank {rank}")
