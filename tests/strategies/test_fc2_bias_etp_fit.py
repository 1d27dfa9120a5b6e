"""`Trainer.fit` of GPT-OSS's expert settings (fc1 and fc2 biases, clamped SwiGLU) under expert-tensor
parallelism equals the single-process run, step by step.

Under ETP every rank's fc2 output is a partial sum over its F block while ``fc2_bias`` is held whole
by every rank: one ETP rank adds it and its gradient is summed over ETP. Oracle:
:func:`strategies.toy.reference_run`, plain PyTorch in one process on the same one-device model and
the same global batches (``test_fit_parity``'s oracle, with these expert settings). On 4 forked gloo
ranks, layouts (EP, ETP, sharding): (1, 2) and (2, 2) replicated, (2, 2) under ``FULL_SHARD``, each
with 2 micro-batches per step and clipping. Compared: the mean of the ranks' losses per micro-batch,
every full gradient before each step (``GradRecorder``, which also asserts that the ETP ranks' whole
copies of ``fc2_bias`` agree exactly) and every parameter after the steps. The biases start at zero
(the model's initialisation), so the steps after the first run with non-zero biases.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from strategies.toy import (
    GradRecorder,
    ToyModule,
    ToyNet,
    full_tensors,
    make_dataset,
    quiet_trainer_kwargs,
    reference_run,
    train_loader,
)

from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

WORLD, STEPS, ACCUMULATE, CLIP = 4, 3, 2, 0.05
NUM_SAMPLES = WORLD * 2 * STEPS * ACCUMULATE  # micro-batches of 2 samples per rank
EXPERTS = dict(activation="clamped_swiglu", activation_limit=0.8, fc1_bias=True, fc2_bias=True)
LAYOUTS = {
    "ep1-etp2": dict(expert_parallel_size=1, expert_tensor_parallel_size=2),
    "ep2-etp2": dict(expert_parallel_size=2, expert_tensor_parallel_size=2),
    "ep2-etp2-full-shard": dict(expert_parallel_size=2, expert_tensor_parallel_size=2, sharding_strategy="FULL_SHARD"),
}
# fp32, as test_fit_parity: the same sums in another order; AdamW moves parameters by ~lr per step.
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-5


class _BiasedToy(ToyModule):
    """The toy module with GPT-OSS's expert settings (the same seed: the reference's initial weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = ToyNet(**EXPERTS)


def _fit(layout: dict) -> dict:
    model, grads = _BiasedToy(), GradRecorder()
    trainer = L.Trainer(
        **quiet_trainer_kwargs(devices=WORLD, strategy=MoEStrategy(**layout), max_steps=STEPS, callbacks=[grads]),
        accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP, gradient_clip_algorithm="norm",
    )
    trainer.fit(model, train_loader(make_dataset(NUM_SAMPLES)))
    params = full_tensors(model.net, dict(model.net.named_parameters()))
    return {"losses": model.losses, "grads": grads.grads, "params": params, "steps": trainer.global_step}


def _all_layouts(rank: int, world: int) -> dict:
    return {name: _fit(layout) for name, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every rank's results per layout (one launch) and the one-process reference."""
    ranks = run_distributed(_all_layouts, WORLD, timeout_s=240, tmp_dir=tmp_path_factory.mktemp("fc2_bias_etp"))
    reference = reference_run(make_dataset(NUM_SAMPLES), STEPS, ACCUMULATE, CLIP, **EXPERTS)
    return ranks, reference


def test_reference_moves_the_fc2_bias(runs):
    """Guard: the biases the later steps run with are not zero (the comparison is not vacuous)."""
    _, ref = runs
    assert ref.params["moe1.experts.fc2_bias"].abs().min() > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fit_matches_single_process(runs, layout):
    ranks, ref = runs
    results = [r[layout] for r in ranks]
    mean_losses = torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(ref.losses, dtype=torch.float64), rtol=LOSS_RTOL,
                               atol=LOSS_ATOL)
    for rank, r in enumerate(results):
        assert r["steps"] == STEPS and len(r["grads"]) == STEPS
        for step, (got, want) in enumerate(zip(r["grads"], ref.grads)):
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                           msg=lambda m, n=name, s=step, k=rank: f"rank {k} step {s} grad {n}: {m}")
        for name, want in ref.params.items():
            torch.testing.assert_close(r["params"][name], want, rtol=PARAM_RTOL, atol=PARAM_ATOL,
                                       msg=lambda m, n=name, k=rank: f"rank {k} param {n}: {m}")
