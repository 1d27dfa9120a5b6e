"""A ``transformers`` Mixtral with swapped MoE blocks, trained by a plain LightningModule under
``MoEStrategy(expert_parallel_size=2)`` on 2 forked gloo ranks, equals ``transformers``' own model
trained in one process.

Oracle: the unswapped ``transformers`` model, trained by plain PyTorch (SGD) on the global batches:
each step's batch is the union of the two data-parallel ranks' batches (Lightning's
DistributedSampler, :func:`strategies.toy.sample_indices`). Compared: per step the mean of the
ranks' losses against the global batch's loss; the final weights (the run's full state loaded into a
one-process swapped copy and written back in the ``transformers`` layout by ``unswap_moe_blocks``);
the tokens per expert of every layer that ``LoadBalanceMonitor`` summed over the ranks, against the
counts of ``transformers``' own routers.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from helpers.hf_swap import VOCAB, tiny_moe_model
from strategies.toy import quiet_trainer_kwargs, sample_indices
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe import MoELayer, swap_moe_blocks, unswap_moe_blocks
from lightning_moe.callbacks import LoadBalanceMonitor
from lightning_moe.strategies import MoEStrategy

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

pytestmark = pytest.mark.distributed

WORLD, EP = 2, 2
STEPS, LOCAL_BATCH, SEQ = 3, 2, 10
NUM_SAMPLES = WORLD * LOCAL_BATCH * STEPS
LR = 0.5
"""Large enough that the weights move well beyond the tolerance in 3 steps (checked)."""
# fp32: the runs differ by summation order only (grad all-reduce, grouped expert GEMMs, softmax of
# the top-k logits instead of renormalised probabilities).
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-5


def _dataset() -> TensorDataset:
    return TensorDataset(torch.randint(3, VOCAB, (NUM_SAMPLES, SEQ), generator=torch.Generator().manual_seed(5)))


def _hf_model() -> torch.nn.Module:
    return tiny_moe_model("mixtral")


class SwappedMixtral(L.LightningModule):
    """What a user writes: a transformers model, its MoE blocks swapped, trained on its own LM loss."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _hf_model()
        swap_moe_blocks(self.model)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def _fit(rank: int, world_size: int) -> dict:
    module = SwappedMixtral()
    monitor = LoadBalanceMonitor(log_every_n_steps=STEPS)
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=world_size, strategy=MoEStrategy(expert_parallel_size=EP), max_steps=STEPS, callbacks=[monitor],
    ))
    trainer.fit(module, DataLoader(_dataset(), batch_size=LOCAL_BATCH))
    state = module.model.state_dict()  # DTensor experts: full_tensor is a collective, same order on every rank
    return {
        "losses": module.losses,
        "local_experts": [m.experts.num_experts for m in module.modules() if isinstance(m, MoELayer)],
        "state": {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()},
        "tokens_per_expert": monitor.last_result["tokens_per_expert"],
    }


def _reference() -> dict:
    """transformers' model trained on the global batches in one process; its routers' counts."""
    model = _hf_model().train()
    routers = [m for m in model.modules() if type(m).__name__ == "MixtralTopKRouter"]
    counts = torch.zeros(len(routers), routers[0].num_experts, dtype=torch.int64)

    def count(layer):
        def hook(module, args, output):
            counts[layer] += torch.bincount(output[2].reshape(-1), minlength=module.num_experts)
        return hook

    for layer, router in enumerate(routers):
        router.register_forward_hook(count(layer))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data, losses = _dataset().tensors[0], []
    for step in range(STEPS):
        indices = [i for r in range(WORLD) for i in sample_indices(r, step, NUM_SAMPLES, WORLD, LOCAL_BATCH)]
        loss = model(input_ids=data[indices], labels=data[indices]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict(), "tokens_per_expert": counts}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ranks = run_distributed(_fit, WORLD, timeout_s=240, tmp_dir=tmp_path_factory.mktemp("hf_swap_fit"))
    return ranks, _reference()


def test_experts_were_sharded(runs):
    ranks, _ = runs
    num_experts = _hf_model().config.num_local_experts
    for r in ranks:
        assert r["local_experts"] == [num_experts // EP] * 2


def test_losses_match_transformers_in_one_process(runs):
    ranks, ref = runs
    mean_of_ranks = torch.tensor([r["losses"] for r in ranks], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean_of_ranks, torch.tensor(ref["losses"], dtype=torch.float64),
                               rtol=LOSS_RTOL, atol=LOSS_ATOL)


def test_weights_written_back_match_transformers_in_one_process(runs):
    ranks, ref = runs
    initial = _hf_model().state_dict()
    for rank, r in enumerate(ranks):
        copy = _hf_model()
        swap_moe_blocks(copy)
        copy.load_state_dict(r["state"], strict=True)
        unswap_moe_blocks(copy)
        got = copy.state_dict()
        assert got.keys() == ref["state"].keys()
        for name, want in ref["state"].items():
            torch.testing.assert_close(got[name], want, rtol=PARAM_RTOL, atol=PARAM_ATOL,
                                       msg=lambda m, n=name, k=rank: f"rank {k} {n}: {m}")
    # The comparison is not vacuous: every expert and router weight moved beyond the tolerance.
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.weight"):
        assert (ref["state"][name] - initial[name]).abs().max() > 100 * PARAM_ATOL, name


def test_load_monitor_counts_match_transformers_routers(runs):
    ranks, ref = runs
    for r in ranks:
        assert torch.equal(r["tokens_per_expert"].to(torch.int64), ref["tokens_per_expert"])
    assert ref["tokens_per_expert"].sum() == 2 * STEPS * WORLD * LOCAL_BATCH * SEQ * 2  # layers x tokens x top-2
