"""`Trainer.fit` with `MoEStrategy` on 4 forked gloo ranks equals the single-process run, step by step.

Oracle (docs/architecture.md §9): :func:`strategies.toy.reference_run`, plain PyTorch in one process,
trains the same one-device model (same seed, so the same initial weights at every layout) on the
same global batches: each optimizer step averages the gradients of the ``DP`` data-parallel shards
(as the DistributedSampler that Lightning injects deals them; it always shuffles training data, see
``strategies.toy.sample_indices``) and
of the accumulated micro-batches, clips by the norm of the whole model's gradient and takes an
AdamW step. With load-balancing losses, each shard's aux loss is computed on that shard's tokens
only, as upstream computes it per data-parallel rank (docs/numerics.md §5.4).

Per case we compare: the samples each rank saw; per micro-batch, the mean of the 4 ranks' local
losses against the loss of the concatenated global batch; per optimizer step, the full gradient
before clipping (expert shards reassembled from all ranks); all parameters after ``STEPS`` steps
(the public state dict, ``.full_tensor()`` for expert DTensors). All cases run in one launch.

Layouts are (TP, EP, ETP) on 4 ranks, TP = CP = 1, so the dense data-parallel size is 4 throughout
and the expert-data-parallel size is 4 / (EP * ETP).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from strategies.toy import (
    DP,
    ContextProbe,
    GradRecorder,
    ToyModule,
    full_tensors,
    make_dataset,
    quiet_trainer_kwargs,
    reference_run,
    sample_indices,
    train_loader,
)

from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

WORLD = 4
STEPS = 3
"""Optimizer steps per run."""
CLIP = 0.05
"""Gradient-norm clip value: below every step's global gradient norm here (checked), so clipping is active."""
AUX_COEFF = 1e-2

# fp32 tolerances. Losses and gradients differ from the single process only by summation order
# (all-reduce over ranks, all-to-all permutation, per-shard means); parameters move by ~lr per step
# under AdamW, which normalises the gradient, so their error is the gradient's relative error times lr.
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-5

LIGHTNING_MESH_NAMES = ("pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel")


@dataclass(frozen=True)
class Case:
    name: str
    layout: tuple[int, int, int]  # (TP, EP, ETP)
    accumulate: int = 1
    clip: float | None = None
    aux: bool = False
    dispatcher: str = "alltoall"

    @property
    def model_kwargs(self) -> dict:
        return _model_kwargs(self.aux)


def _model_kwargs(aux: bool) -> dict:
    return {"load_balancing": ["aux_loss"], "aux_loss_coeff": AUX_COEFF} if aux else {}


LAYOUTS = [(1, 1, 1), (1, 2, 1), (1, 4, 1), (1, 2, 2)]
CASES = [
    *(Case(f"tp{t}-ep{e}-etp{et}", (t, e, et)) for t, e, et in LAYOUTS),
    *(Case(f"tp{t}-ep{e}-etp{et}-accum2-clip", (t, e, et), accumulate=2, clip=CLIP) for t, e, et in LAYOUTS),
    Case("tp1-ep2-etp1-clip", (1, 2, 1), clip=CLIP),
    Case("tp1-ep2-etp1-accum2-clip-aux", (1, 2, 1), accumulate=2, clip=CLIP, aux=True),
    Case("tp1-ep4-etp1-allgather-accum2", (1, 4, 1), accumulate=2, dispatcher="allgather"),
    Case("tp1-ep2-etp2-flex-accum2-clip-aux", (1, 2, 2), accumulate=2, clip=CLIP, aux=True, dispatcher="flex"),
]
NUM_SAMPLES = DP * 2 * STEPS * 2  # enough micro-batches of 2 samples for STEPS steps with accumulation 2


def _fit_case(case: Case) -> dict:
    tp, ep, etp = case.layout
    model = ToyModule(**case.model_kwargs)
    probe, grads = ContextProbe(), GradRecorder()
    strategy = MoEStrategy(
        tensor_parallel_size=tp, expert_parallel_size=ep, expert_tensor_parallel_size=etp, dispatcher=case.dispatcher
    )
    trainer = L.Trainer(
        **quiet_trainer_kwargs(devices=WORLD, strategy=strategy, max_steps=STEPS, callbacks=[probe, grads]),
        accumulate_grad_batches=case.accumulate,
        gradient_clip_val=case.clip,
        gradient_clip_algorithm="norm" if case.clip is not None else None,
    )
    trainer.fit(model, train_loader(make_dataset(NUM_SAMPLES)))
    state = model.state_dict()  # collective for expert DTensors: same order on every rank
    params = {k.removeprefix("net."): v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
              for k, v in state.items() if k.startswith("net.")}
    gathered = full_tensors(model.net, dict(model.net.named_parameters()))
    return {
        "losses": model.losses, "seen": model.seen, "global_step": trainer.global_step,
        "logged_loss": trainer.callback_metrics["loss"].item(),
        "grads": grads.grads, "clipped": grads.clipped, "params": params, "gathered": gathered,
        "probe_setup": probe.probe, "probe_configure_model": model.configure_model_probe,
    }


def _all_cases(rank: int, world_size: int) -> dict[str, dict]:
    return {case.name: _fit_case(case) for case in CASES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Rank results per case (one 4-rank launch for every case) and the reference per case."""
    ranks = run_distributed(_all_cases, WORLD, timeout_s=240, tmp_dir=tmp_path_factory.mktemp("fit_parity"))
    return {case.name: ([r[case.name] for r in ranks], _reference(case.accumulate, case.clip, case.aux)) for case in CASES}


@functools.cache
def _reference(accumulate: int, clip: float | None, aux: bool):
    """The single-process oracle of every case with this accumulation, clip value and aux loss.

    It does not depend on the layout or the dispatcher (one device, the model seeded alike), so the
    cases that share these three settings share one run; the tests only read it."""
    return reference_run(make_dataset(NUM_SAMPLES), STEPS, accumulate, clip, **_model_kwargs(aux))


def _ids(cases):
    return [c.name for c in cases]


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_ranks_see_their_data_parallel_shards(runs, case):
    ranks, _ = runs[case.name]
    dp_ranks = sorted(r["probe_setup"]["dp_rank"] for r in ranks)
    assert dp_ranks == list(range(DP))
    for r in ranks:
        dp_rank = r["probe_setup"]["dp_rank"]
        assert r["global_step"] == STEPS
        assert r["seen"] == [sample_indices(dp_rank, i, NUM_SAMPLES) for i in range(STEPS * case.accumulate)]


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_losses_match_single_process(runs, case):
    ranks, ref = runs[case.name]
    mean_of_ranks = torch.tensor([r["losses"] for r in ranks], dtype=torch.float64).mean(0)
    assert len(ref.losses) == STEPS * case.accumulate == len(mean_of_ranks)
    torch.testing.assert_close(mean_of_ranks, torch.tensor(ref.losses, dtype=torch.float64),
                               rtol=LOSS_RTOL, atol=LOSS_ATOL)
    # self.log(..., sync_dist=True) reduced the last micro-batch's loss over the ranks (mean).
    for r in ranks:
        assert r["logged_loss"] == pytest.approx(mean_of_ranks[-1].item(), rel=LOSS_RTOL, abs=LOSS_ATOL)


@pytest.mark.parametrize("when", ["before_clipping", "after_clipping"])
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_gradients_match_single_process(runs, case, when):
    """Full gradients per step: before clipping (``on_before_optimizer_step``) and as the optimizer
    sees them (clipped by the global norm, which AdamW's scale invariance would otherwise hide)."""
    ranks, ref = runs[case.name]
    key, wanted = ("grads", ref.grads) if when == "before_clipping" else ("clipped", ref.clipped)
    for rank, r in enumerate(ranks):
        assert len(r[key]) == STEPS
        for step, (got, want) in enumerate(zip(r[key], wanted)):
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                           msg=lambda m, n=name, s=step, k=rank: f"rank {k} step {s} grad {n}: {m}")


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_parameters_match_single_process(runs, case):
    ranks, ref = runs[case.name]
    for rank, r in enumerate(ranks):
        assert r["params"].keys() == ref.state.keys()
        for name, want in ref.state.items():
            torch.testing.assert_close(r["params"][name], want, rtol=PARAM_RTOL, atol=PARAM_ATOL,
                                       msg=lambda m, n=name, k=rank: f"rank {k} param {n}: {m}")
        for name, want in ref.params.items():
            torch.testing.assert_close(r["gathered"][name], want, rtol=PARAM_RTOL, atol=PARAM_ATOL,
                                       msg=lambda m, n=name, k=rank: f"rank {k} gathered param {n}: {m}")
            # The public state dict (DTensor.full_tensor) and an independent gather of the shards agree
            # exactly; a gated fc1 is presented as [E, 2, F, H], a view of the stored [E, 2F, H].
            public = r["params"][name]
            torch.testing.assert_close(public, r["gathered"][name].view(public.shape), rtol=0, atol=0)
        # Parameters moved away from their initial values (the comparison is not vacuous).
        initial = ToyModule(**case.model_kwargs).net.state_dict()["moe1.experts.fc1_weight"]
        assert initial.shape == r["params"]["moe1.experts.fc1_weight"].shape
        assert not torch.equal(r["params"]["moe1.experts.fc1_weight"], initial)


def test_clipping_was_active():
    """Guard for CLIP: the full-model gradient norm exceeds it at every step of every clipped case."""
    for case in CASES:
        if case.clip is None:
            continue
        ref = _reference(case.accumulate, None, case.aux)
        assert min(ref.norms) > 2 * case.clip, (case.name, ref.norms)


def test_aux_loss_changes_the_gradients(runs):
    """The aux-loss case is not vacuous: its router gradients differ from the same case without it."""
    ranks, ref = runs["tp1-ep2-etp1-accum2-clip-aux"]
    plain = _reference(2, CLIP, False)
    diff = (ref.grads[0]["moe1.router.weight"] - plain.grads[0]["moe1.router.weight"]).abs().max()
    assert diff > 100 * GRAD_ATOL
    # The distributed aux-loss run matches the per-shard oracle (checked above), not the concatenated one.
    got = ranks[0]["grads"][0]["moe1.router.weight"]
    torch.testing.assert_close(got, ref.grads[0]["moe1.router.weight"], rtol=GRAD_RTOL, atol=GRAD_ATOL)


@pytest.mark.parametrize("case", [c for c in CASES if c.name in {"tp1-ep1-etp1", "tp1-ep4-etp1", "tp1-ep2-etp2"}],
                         ids=lambda c: c.name)
def test_parallel_context_readable_from_configure_model_and_callback_setup(runs, case):
    ranks, _ = runs[case.name]
    _, ep, etp = case.layout
    expected_sizes = {"tp": 1, "cp": 1, "dp": DP, "ep": ep, "etp": etp, "edp": WORLD // (ep * etp)}
    for r in ranks:
        for probe in (r["probe_setup"], r["probe_configure_model"]):
            assert probe is not None
            assert probe["sizes"] == expected_sizes
            assert probe["mesh_dim_names"] == LIGHTNING_MESH_NAMES
            assert probe["mesh_shape"] == (1, DP, 1, 1)
            assert probe["module_mesh_is_strategy_mesh"]
            assert probe["sampler_kwargs"] == {"num_replicas": DP, "rank": probe["dp_rank"]}
