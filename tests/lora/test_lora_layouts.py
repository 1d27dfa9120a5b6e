"""LoRA training with `MoELanguageModel(lora=...)` under `MoEStrategy` equals one process.

Oracle: plain PyTorch in one process (no Lightning, no strategy): the same one-device model (same
seed, so the same base weights and adapters) with the same adapters trained by AdamW with the
module's own parameter groups and schedule, on the same global batches (the union of the ranks'
shards as Lightning's DistributedSampler deals them: ``strategies.toy.sample_indices``), averaged
over gradient-accumulation micro-batches and clipped by the norm of the whole gradient.

Layouts on 4 forked gloo ranks, as (TP, EP, ETP, sharding): EP=1 (data parallelism only), EP=2,
EP=4, ETP=2 (with EP=2), TP=2 (with EP=2, ETP=1), FULL_SHARD (EP=2) and ETP=2 with FULL_SHARD,
each with 2 micro-batches per step and clipping. Compared: every adapter's reduced gradient before
each optimizer step (unclipped), the mean over the ranks of each micro-batch's loss, and every
adapter after the steps (the public state dict, ``full_tensor()`` of the sharded ones); the base
stays unchanged and frozen.

AdamW runs with ``eps=1e-2`` on both sides. ``B`` starts at zero, so ``A``'s gradient is exactly
zero at the first step and its first non-zero gradient enters Adam alone: the step is
``lr * g / (|g| + eps)``, whose gain on a rounding difference of ``g`` is ``lr / eps`` where
``|g| << eps``. With torch's ``eps=1e-8`` that is 1e6, and the adapters would compare the order of
the reductions (differences of 1e-11 in gradients of 1e-6) rather than the layout; ``eps=1e-2``
bounds the gain to 1, as the tensor-parallel tests of the base model do. The gradients themselves
are compared directly, to ``GRAD_TOL`` of their largest element.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.asserts import assert_close_to_scale
from helpers.dist import run_distributed
from strategies.toy import quiet_trainer_kwargs, sample_indices
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.lit.optimization import optimizer_param_groups, warmup_cosine
from lightning_moe.lora import LoRAConfig, is_adapter_key
from lightning_moe.models import MoETransformerConfig
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

WORLD, STEPS, ACCUMULATE, GLOBAL_BATCH, SEQ, VOCAB = 4, 2, 2, 4, 8, 64
CLIP = 0.05  # below the gradient norms here, so clipping acts (checked on the oracle)
LR, WARMUP = 1e-2, 1
NUM_SAMPLES = GLOBAL_BATCH * STEPS * ACCUMULATE
# fp32: the same sums in another order (all-reduces, all-to-all permutation, per-shard means); AdamW
# moves each adapter by about lr per step, so their error is the gradients' relative error times lr.
LOSS_TOL, PARAM_TOL, GRAD_TOL = 1e-5, 1e-5, 1e-5
ADAM_EPS = 1e-2  # module docstring
LAYOUTS = {
    "ep1": dict(expert_parallel_size=1),
    "ep2": dict(expert_parallel_size=2),
    "ep4": dict(expert_parallel_size=4),
    "ep2-etp2": dict(expert_parallel_size=2, expert_tensor_parallel_size=2),
    "tp2-ep2": dict(tensor_parallel_size=2, expert_parallel_size=2, expert_tensor_parallel_size=1),
    "ep2-full-shard": dict(expert_parallel_size=2, sharding_strategy="FULL_SHARD"),
    "ep2-etp2-full-shard": dict(expert_parallel_size=2, expert_tensor_parallel_size=2, sharding_strategy="FULL_SHARD"),
}


def _config() -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=32,
        first_dense_layers=0, max_seq_len=SEQ,
        moe=MoEConfig(32, 16, 4, top_k=2, shared_expert_ffn_hidden_size=16),
    )


LORA = LoRAConfig(rank=4, alpha=8.0)


def _module() -> MoELanguageModel:
    torch.manual_seed(0)
    module = _Recording(_config(), learning_rate=LR, warmup_steps=WARMUP, lora=LORA)
    module.losses, module.grads = [], []
    return module


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (NUM_SAMPLES, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class _Recording(MoELanguageModel):
    """Records each micro-batch's local loss (Lightning's step outputs are divided by the accumulation)
    and the reduced adapter gradients before each optimizer step; AdamW with ``ADAM_EPS``."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        config = super().configure_optimizers()
        for group in config["optimizer"].param_groups:
            group["eps"] = ADAM_EPS
        return config

    def on_before_optimizer_step(self, optimizer):
        self.grads.append(_adapter_grads(self.model))


def _full_state(model: torch.nn.Module) -> dict:
    state = model.state_dict()  # a collective for DTensors: same order on every rank
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


@torch.no_grad()
def _adapter_grads(model: torch.nn.Module) -> dict:
    """Every adapter's gradient in the state dict's global layout: written into the parameters for
    the length of one ``state_dict()`` (which knows every layout), then the values are put back."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    for param in params:
        param.copy_(param.grad)
    grads = {k: v for k, v in _full_state(model).items() if is_adapter_key(k)}
    for param, value in zip(params, saved):
        param.copy_(value)
    return grads


def _adapters(module: MoELanguageModel) -> tuple[dict, dict]:
    full = _full_state(module.model)
    frozen = [n for n, p in module.model.named_parameters() if p.requires_grad != is_adapter_key(n)]
    assert not frozen, f"parameters whose requires_grad is not 'is an adapter': {frozen}"
    return ({k: v for k, v in full.items() if is_adapter_key(k)},
            {k: v for k, v in full.items() if not is_adapter_key(k)})


def _fit(layout: dict) -> dict:
    module = _module()
    dp = WORLD // layout.get("tensor_parallel_size", 1)
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=WORLD, strategy=MoEStrategy(**layout), max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP, gradient_clip_algorithm="norm",
    ))
    trainer.fit(module, DataLoader(_dataset(), batch_size=GLOBAL_BATCH // dp))
    adapters, base = _adapters(module)
    return {"losses": module.losses, "grads": module.grads, "adapters": adapters, "base": base}


def _all_layouts(rank: int, world: int) -> dict:
    return {name: _fit(layout) for name, layout in LAYOUTS.items()}


def _reference() -> dict:
    module = _module()
    module.configure_model()
    model = module.model
    optimizer = torch.optim.AdamW(optimizer_param_groups(module, module.hparams.weight_decay), lr=LR,
                                  betas=tuple(module.hparams.betas), eps=ADAM_EPS)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, WARMUP, STEPS, 0.1))
    inputs, targets = _dataset().tensors
    losses, norms, grads = [], [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(ACCUMULATE):
            # The union of the DP ranks' m-th micro-batches: the same block for every DP size.
            rows = [i for r in range(2) for i in sample_indices(r, step * ACCUMULATE + micro, NUM_SAMPLES, 2,
                                                                  GLOBAL_BATCH // 2)]
            loss = module._loss(model(inputs[rows]), targets[rows])
            (loss / ACCUMULATE).backward()
            losses.append(loss.item())
        grads.append(_adapter_grads(model))
        params = [p for p in model.parameters() if p.requires_grad]
        norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
        optimizer.step()
        schedule.step()
    state = _full_state(model)
    return {"losses": losses, "norms": norms, "grads": grads,
            "adapters": {k: v for k, v in state.items() if is_adapter_key(k)},
            "base": {k: v for k, v in state.items() if not is_adapter_key(k)}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ranks = run_distributed(_all_layouts, WORLD, timeout_s=400, tmp_dir=tmp_path_factory.mktemp("lora_layouts"))
    return ranks, _reference()


def test_oracle_clips_and_trains(runs):
    _, ref = runs
    assert all(norm > CLIP for norm in ref["norms"])
    assert any(v.abs().max() > 0 for k, v in ref["adapters"].items() if k.endswith("lora_B"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_adapter_gradients_match_one_process(runs, layout):
    ranks, ref = runs
    for rank, r in enumerate(ranks):
        assert len(r[layout]["grads"]) == STEPS
        for step, (got, want) in enumerate(zip(r[layout]["grads"], ref["grads"])):
            assert got.keys() == want.keys()
            for name, value in want.items():
                assert_close_to_scale(got[name], value, GRAD_TOL, f"{layout} rank {rank} step {step} grad {name}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_and_adapters_match_one_process(runs, layout):
    ranks, ref = runs
    losses = torch.tensor([r[layout]["losses"] for r in ranks], dtype=torch.float64).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"], dtype=torch.float64), rtol=LOSS_TOL, atol=LOSS_TOL)
    for rank, r in enumerate(ranks):
        got = r[layout]["adapters"]
        assert got.keys() == ref["adapters"].keys()
        for name, want in ref["adapters"].items():
            torch.testing.assert_close(got[name], want, rtol=PARAM_TOL, atol=PARAM_TOL,
                                       msg=lambda m, n=name, k=rank: f"{layout} rank {k} {n}: {m}")
        assert r[layout]["base"].keys() == ref["base"].keys()
        for name, want in ref["base"].items():  # frozen
            torch.testing.assert_close(r[layout]["base"][name], want, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
