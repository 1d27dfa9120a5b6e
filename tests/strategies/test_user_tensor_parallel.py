"""A user's own tensor parallelism (``parallelize_module`` on ``self.device_mesh["tensor_parallel"]``) under `MoEStrategy`.

The model (:mod:`strategies.user_tp`) is written as for Lightning's ``ModelParallelStrategy``: its
``configure_model`` shards its own MLP (column- then row-parallel) and it holds a
:class:`~lightning_moe.MoELayer` (shared expert, aux loss) that lightning_moe parallelizes.

Oracle: :func:`strategies.user_tp.reference_run`, plain PyTorch in one process (no DTensor), on the
same global batches. Per layout, with gradient accumulation 2 and norm clipping active: the mean
of the ranks' losses per micro-batch equals the global batch's loss, the full gradients (DTensors
and expert shards reassembled) before clipping equal the oracle's per step, and so do the final
weights. Layouts: TP=2 at world 2 (with and without the model's plan), TP=2 x EP=2 at world 4,
with and without FSDP2 (``FULL_SHARD``).

Checkpoints (oracle: the state a run holds right after loading equals, bit for bit, the state the
saving run held, weights and AdamW moments): a sharded checkpoint saved at TP=2 x EP=2 resumes in
one process and one saved in one process resumes at TP=2 x EP=2; a consolidated file written at
TP=2 x EP=2 under FSDP2 holds the one-device model's global tensors and loads in one process.

Also: the MoE layer's token split on its own (plain ``[B, S, H]`` input with a padding mask,
``[T, H]``, a DTensor input) equals the one-device layer, and the errors (a mesh dim that does not
exist, inputs that differ between TP ranks, a length TP does not divide).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback
from strategies.toy import full_tensors, quiet_trainer_kwargs, train_loader
from strategies.user_tp import UserTPModule, UserTPNet, make_dataset, reference_run
from torch.distributed.tensor import DTensor

from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

STEPS, ACCUMULATE, CLIP = 3, 2, 0.05
NUM_SAMPLES = 32
"""Enough for STEPS x ACCUMULATE micro-batches of 2 samples on each of 2 data-parallel replicas."""
# fp32: the layouts sum in other orders than one process (all-reduces, the all-to-all's permutation).
LOSS_TOL, GRAD_RTOL, GRAD_ATOL, PARAM_TOL = 1e-5, 1e-4, 1e-6, 1e-5


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    tp: int
    ep: int = 1
    sharding: str = "NO_SHARD"
    tp_plan: bool = True

    @property
    def dp(self) -> int:
        return self.world // self.tp


CASES = [
    Case("tp2", 2, 2),
    Case("tp2-no-model-plan", 2, 2, tp_plan=False),
    Case("tp2-ep2", 4, 2, 2),
    Case("tp2-ep2-full-shard", 4, 2, 2, "FULL_SHARD"),
]


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


class Record(Callback):
    """Full gradients before each optimizer step; the full state right after loading and at the end."""

    def __init__(self) -> None:
        self.grads: list[dict] = []
        self.start: dict | None = None
        self.end: dict | None = None

    @staticmethod
    def state(trainer) -> dict:
        strategy = trainer.strategy
        weights = {k: _full(v) for k, v in strategy.lightning_module_state_dict().items()}
        entries = strategy.optimizer_state(trainer.optimizers[0])["state"]
        moments = {f"{n}/{k}": _full(v) for n, e in entries.items() for k, v in e.items() if k != "step"}
        return {"weights": weights, "moments": moments, "step": trainer.global_step}

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = self.state(trainer)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append(full_tensors(pl_module.net, {n: p.grad for n, p in pl_module.net.named_parameters()}))

    def on_train_end(self, trainer, pl_module) -> None:
        self.end = self.state(trainer)


def _fit(world: int, tp: int = 1, ep: int = 1, sharding: str = "NO_SHARD", tp_plan: bool = True, steps: int = STEPS,
         accumulate: int = ACCUMULATE, resume: Path | None = None, save: Path | None = None,
         distributed_checkpoint: bool = True) -> dict:
    module, record = UserTPModule(tp_plan=tp_plan), Record()
    strategy = MoEStrategy(tensor_parallel_size=tp, expert_parallel_size=ep, sharding_strategy=sharding,
                           save_distributed_checkpoint=distributed_checkpoint)
    trainer = L.Trainer(
        **quiet_trainer_kwargs(devices=world, strategy=strategy, max_steps=steps, callbacks=[record]),
        accumulate_grad_batches=accumulate, gradient_clip_val=CLIP,
    )
    trainer.fit(module, train_loader(make_dataset(NUM_SAMPLES)), ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    params = {k: _full(v) for k, v in module.net.state_dict().items()}
    return {"losses": module.losses, "grads": record.grads, "params": params, "start": record.start, "end": record.end}


def _case(case: Case) -> dict:
    return _fit(case.world, case.tp, case.ep, case.sharding, case.tp_plan)


def _two_ranks(rank: int, world_size: int) -> dict:
    out = {c.name: _case(c) for c in CASES if c.world == 2}
    try:
        L.Trainer(**quiet_trainer_kwargs(devices=2, strategy=MoEStrategy(tensor_parallel_size=2), max_steps=1)).fit(
            UserTPModule(mesh_dim="tp"), train_loader(make_dataset(NUM_SAMPLES)))
        out["bad_mesh_dim"] = "trained"
    except KeyError as err:
        out["bad_mesh_dim"] = str(err)
    return out


def _four_ranks(rank: int, world_size: int, root: str) -> dict:
    out = {c.name: _case(c) for c in CASES if c.world == 4}
    out["save"] = _fit(4, 2, 2, steps=2, accumulate=1, save=Path(root) / "tp2ep2.ckpt")
    out["save_file"] = _fit(4, 2, 2, "FULL_SHARD", steps=2, accumulate=1, save=Path(root) / "tp2ep2.pt",
                            distributed_checkpoint=False)
    out["resume_one"] = _fit(4, 2, 2, steps=3, accumulate=1, resume=Path(root) / "one.ckpt")
    return out


def _one_process_saves(rank: int, world_size: int, root: str) -> dict:
    return _fit(1, steps=2, accumulate=1, save=Path(root) / "one.ckpt")


def _one_process_resumes(rank: int, world_size: int, root: str) -> dict:
    return {"sharded": _fit(1, steps=3, accumulate=1, resume=Path(root) / "tp2ep2.ckpt"),
            "file": _fit(1, steps=3, accumulate=1, resume=Path(root) / "tp2ep2.pt")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("user_tp"))
    (one,) = run_distributed(_one_process_saves, 1, root, timeout_s=120, tmp_dir=tmp_path_factory.mktemp("pg1"))
    two = run_distributed(_two_ranks, 2, timeout_s=180, tmp_dir=tmp_path_factory.mktemp("pg2"))
    four = run_distributed(_four_ranks, 4, root, timeout_s=300, tmp_dir=tmp_path_factory.mktemp("pg4"))
    (resumed,) = run_distributed(_one_process_resumes, 1, root, timeout_s=120, tmp_dir=tmp_path_factory.mktemp("pg1b"))
    return {"one": one, "two": two, "four": four, "resumed": resumed, "root": Path(root)}


@pytest.fixture(scope="module")
def references():
    return {dp: reference_run(make_dataset(NUM_SAMPLES), dp, STEPS, ACCUMULATE, CLIP) for dp in (1, 2)}


def _ranks(runs, case: Case) -> list[dict]:
    return [r[case.name] for r in runs["two" if case.world == 2 else "four"]]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_training_equals_one_process(runs, references, case):
    ranks, ref = _ranks(runs, case), references[case.dp]
    mean = torch.tensor([r["losses"] for r in ranks], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref.losses, dtype=torch.float64), rtol=LOSS_TOL, atol=LOSS_TOL)
    for k, r in enumerate(ranks):
        assert len(r["grads"]) == STEPS
        for step, (got, want) in enumerate(zip(r["grads"], ref.grads)):
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                           msg=lambda m, n=name, s=step, k=k: f"rank {k} step {s} grad {n}: {m}")
        assert r["params"].keys() == ref.state.keys()
        for name, want in ref.state.items():
            torch.testing.assert_close(r["params"][name], want, rtol=PARAM_TOL, atol=PARAM_TOL,
                                       msg=lambda m, n=name, k=k: f"rank {k} param {n}: {m}")
    initial = UserTPNet().state_dict()
    assert not torch.equal(ranks[0]["params"]["up.weight"], initial["up.weight"])  # it trained


def test_clipping_was_active(references):
    """Guard for CLIP: the whole model's gradient norm exceeds it at every step of the oracle."""
    for ref in references.values():
        assert min(ref.norms) > CLIP, ref.norms


def _assert_identical(loaded: dict, saved: dict, what: str, parts=("weights", "moments")) -> None:
    for part in parts:
        assert loaded[part].keys() == saved[part].keys(), (what, part)
        for name, value in saved[part].items():
            torch.testing.assert_close(loaded[part][name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{what} {n}: {m}")


def test_checkpoint_saved_at_tp2_ep2_resumes_in_one_process(runs):
    saved = runs["four"][0]["save"]["end"]
    assert saved["moments"]
    _assert_identical(runs["resumed"]["sharded"]["start"], saved, "TP2xEP2 -> one process")
    assert runs["resumed"]["sharded"]["start"]["step"] == saved["step"] == 2


def test_checkpoint_saved_in_one_process_resumes_at_tp2_ep2(runs):
    for rank in runs["four"]:
        _assert_identical(rank["resume_one"]["start"], runs["one"]["end"], "one process -> TP2xEP2")


def test_consolidated_file_holds_the_global_tensors(runs):
    saved = runs["four"][0]["save_file"]["end"]["weights"]
    state = torch.load(runs["root"] / "tp2ep2.pt", weights_only=True)["state_dict"]
    one_device = {f"net.{k}": v for k, v in UserTPNet().state_dict().items()}
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in one_device.items()}
    assert not any(isinstance(v, DTensor) for v in state.values())
    for name, value in saved.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    _assert_identical(runs["resumed"]["file"]["start"], runs["four"][0]["save_file"]["end"], "file", ("weights",))


def test_an_unknown_mesh_dim_name_is_a_clear_error(runs):
    for rank in runs["two"]:
        message = rank["bad_mesh_dim"]
        assert "MoEStrategy's device mesh has no dim 'tp'" in message, message
        assert "'tensor_parallel'" in message and "use 'tp' -> 'tensor_parallel'" in message, message
