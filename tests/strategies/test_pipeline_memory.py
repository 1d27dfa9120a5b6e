"""Selective recompute, activation offload and the load-balance monitor under pipeline parallelism.

Oracle: the same PP=2 (1F1B, ``num_microbatches=4``) run on 2 forked gloo ranks without the
callback (itself checked against gradient accumulation on one process by ``test_pipeline_parity.py``).
With ``SelectiveRecompute(modules=("moe_act", "router", "layernorm"))``,
``ActivationOffload(modules=OFFLOAD_MODULES, min_tensor_bytes=0)`` (under 1F1B and GPipe, the
latter against GPipe without it) or ``LoadBalanceMonitor(log_every_n_steps=1)``, the loss of
every step, the validation loss and every parameter and expert bias after 3 AdamW steps must match
at fp32 tolerance (aux loss, z loss, expert bias and clipping on), and each callback did its work.
Offload runs one offload micro-batch per pipeline micro-batch and stage: the counts of kept and
offloaded groups follow from the warm-up rule and the stages' blocks, and nothing is reloaded on
demand, although 1F1B's warm-up and GPipe run several forwards back to back.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.asserts import assert_states_close
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback
from strategies.test_pipeline_parity import CLIP, Measure, dataset, model_config
from strategies.toy import quiet_trainer_kwargs
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_moe.callbacks import ActivationOffload, LoadBalanceMonitor, SelectiveRecompute
from lightning_moe.lit import MoELanguageModel
from lightning_moe.memory import OFFLOAD_MODULES
from lightning_moe.parallel.pipeline.split import layer_split
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

STEPS, M, BATCH = 3, 4, 8
CALLBACKS = {
    "recompute": lambda: SelectiveRecompute(modules=("moe_act", "router", "layernorm")),
    "offload": lambda: ActivationOffload(modules=OFFLOAD_MODULES, min_tensor_bytes=0),
    "monitor": lambda: LoadBalanceMonitor(log_every_n_steps=1),
}


class Capture(Callback):
    """What the callback under test did, read when training ends (its ``teardown`` clears it)."""

    def __init__(self, callback: Callback | None) -> None:
        self.callback, self.did = callback, {}

    def on_train_end(self, trainer, pl_module) -> None:
        if isinstance(self.callback, SelectiveRecompute):
            self.did = {name: len(modules) for name, modules in self.callback.applied.items()}
        elif isinstance(self.callback, ActivationOffload):
            stats = self.callback.stats
            self.did = {"offloaded_bytes": stats.offloaded_bytes, "reloaded_bytes": stats.reloaded_bytes,
                        "offloaded_groups": stats.offloaded_groups, "kept_groups": stats.kept_groups,
                        "reloads_on_demand": stats.reloads_on_demand}
        elif isinstance(self.callback, LoadBalanceMonitor):
            self.did = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("moe/")}


def _fit(name: str | None, pp: int = 2, schedule: str = "1F1B") -> dict:
    torch.manual_seed(0)
    module = MoELanguageModel(model_config(), learning_rate=1e-2, warmup_steps=0)
    accumulate = 1 if pp > 1 else M
    measure = Measure(accumulate)
    extra = [] if name is None else [CALLBACKS[name]()]
    capture = Capture(extra[0] if extra else None)
    strategy = MoEStrategy(pipeline_parallel_size=pp, pipeline_schedule=schedule, num_microbatches=M if pp > 1 else None)
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=pp, strategy=strategy, max_steps=STEPS, callbacks=[measure, *extra, capture], gradient_clip_val=CLIP,
        accumulate_grad_batches=accumulate, limit_val_batches=accumulate, log_every_n_steps=1,
    ))
    batch = BATCH // accumulate
    trainer.fit(module, DataLoader(dataset(STEPS * BATCH), batch_size=batch),
                DataLoader(dataset(BATCH), batch_size=batch))
    return {
        "losses": torch.tensor(measure.losses).reshape(STEPS, -1).mean(1),
        "val_loss": trainer.callback_metrics.get("val_loss"), "did": capture.did,
        "state": {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                  for k, v in module.state_dict().items()},
    }


def _runs(rank: int, world_size: int) -> dict:
    runs = {name: _fit(name) for name in (None, *CALLBACKS)}
    runs["GPipe"], runs["GPipe offload"] = _fit(None, schedule="GPipe"), _fit("offload", schedule="GPipe")
    return runs


def _reference(rank: int, world_size: int) -> dict:
    return _fit("recompute", pp=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_memory")
    return run_distributed(_reference, 1, timeout_s=120, tmp_dir=tmp)[0], run_distributed(
        _runs, 2, timeout_s=300, tmp_dir=tmp)


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert len(got["losses"]) == STEPS and got["val_loss"] is not None, what
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} losses: {m}")
    torch.testing.assert_close(got["val_loss"], want["val_loss"], rtol=1e-5, atol=1e-6)
    assert_states_close(got["state"], want["state"], 1e-5, 1e-5, what)


@pytest.mark.parametrize("name", ["offload", "monitor"])
def test_callback_leaves_pipeline_training_unchanged(runs, name):
    for rank, result in enumerate(runs[1]):
        assert result[name]["state"].keys() == result[None]["state"].keys(), rank
        _assert_same(result[name], result[None], f"rank {rank}")


def test_recompute_under_pipeline_equals_recompute_in_one_process(runs):
    # layernorm recompute is not bitwise even in one process (the norm weights' gradients are
    # summed in another order; tests/memory/test_recompute.py), so its oracle is the one-process
    # run with the same recompute, on the same micro-batches.
    want, ranks = runs
    merged: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(ranks):
        got = result["recompute"]
        assert got["did"] and min(got["did"].values()) > 0, (rank, got["did"])
        _assert_same(got, {**want, "state": {k: want["state"][k] for k in got["state"]}}, f"rank {rank}")
        merged.update(got["state"])
    assert merged.keys() == want["state"].keys()


def _expected_groups(rank: int) -> tuple[int, int]:
    """(kept, offloaded) groups of rank ``rank``'s stage over the whole run, from the warm-up rule.

    PP=2 splits the blocks evenly (``layer_split``: blocks 0-1 and 2-3), of which those from
    ``first_dense_layers`` on are MoE blocks. Each block has one boundary of every attention-side
    name, each MoE block one of each expert name. Per micro-batch the last group of each name
    stays on the device, every earlier one is offloaded.
    """
    config = model_config()
    counts = layer_split(config.num_layers, 2)
    blocks = range(sum(counts[:rank]), sum(counts[: rank + 1]))
    moe_blocks = [b for b in blocks if b >= config.first_dense_layers]
    per_name = {name: len(moe_blocks) if name in ("expert_fc1", "moe_act") else len(blocks) for name in OFFLOAD_MODULES}
    kept = sum(1 for n in per_name.values() if n > 0)
    offloaded = sum(n - 1 for n in per_name.values() if n > 0)
    return STEPS * M * kept, STEPS * M * offloaded


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_offload_runs_one_offload_microbatch_per_pipeline_microbatch(runs, schedule):
    key = "offload" if schedule == "1F1B" else "GPipe offload"
    for rank, result in enumerate(runs[1]):
        did = result[key]["did"]
        kept, offloaded = _expected_groups(rank)
        assert did["reloads_on_demand"] == 0, (rank, did)  # every backward finds its group prefetched or kept
        assert did["reloaded_bytes"] == did["offloaded_bytes"] > 0, (rank, did)
        assert (did["kept_groups"], did["offloaded_groups"]) == (kept, offloaded), (rank, did)
        if schedule == "GPipe":
            _assert_same(result[key], result["GPipe"], f"rank {rank} GPipe")


def test_monitor_reports_under_pipeline(runs):
    for rank, result in enumerate(runs[1]):
        did = result["monitor"]["did"]
        assert did and all(torch.isfinite(torch.tensor(v)) for v in did.values()), (rank, did)
