"""Aux and z-loss gradients scale exactly like the main loss: GradScaler (16-mixed) and accumulation.

The model is one MoE layer whose main loss is ``0 * output``: every router-weight gradient then
comes from the attached losses alone. Oracle: the aux (Switch) loss and z-loss written out here
in plain autograd, fp32, on each micro-batch; a step's gradient is the mean over its
micro-batches (Lightning divides the loss by ``accumulate_grad_batches``), and under `MoEStrategy`
additionally the mean over the data-parallel ranks. ``16-mixed`` runs through a CPU GradScaler
(``torch.amp.GradScaler("cpu")``, initial scale 2**16): without the right scale the unscaled aux
gradient comes out 65536x too small. The router computes in fp32 under autocast, so the match is
at fp32 tolerance.
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.callbacks import MoELossScaling
from lightning_moe.layers import set_aux_loss_scale
from lightning_moe.layers.losses import UNMANAGED_SCALE_WARNING
from lightning_moe.strategies import MoEStrategy

HIDDEN, EXPERTS, TOP_K, SEQ, BATCH = 8, 4, 2, 6, 2
AUX_COEFF, Z_COEFF = 0.1, 0.01
INIT_SCALE = 2.0**16
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7


def _layer() -> MoELayer:
    torch.manual_seed(3)
    return MoELayer(MoEConfig(HIDDEN, 4, EXPERTS, top_k=TOP_K, load_balancing=["aux_loss"],
                              aux_loss_coeff=AUX_COEFF, z_loss_coeff=Z_COEFF, init_std=0.5))


def _dataset(num: int) -> TensorDataset:
    return TensorDataset(torch.randn(num, SEQ, HIDDEN, generator=torch.Generator().manual_seed(11)))


def aux_oracle_grad(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d(aux_loss + z_loss)/d(router weight) for one micro-batch ``x`` [B, S, H] (fp32)."""
    w = weight.detach().clone().requires_grad_()
    logits = x.reshape(-1, HIDDEN) @ w.t()
    scores = torch.softmax(logits, -1)
    picked = torch.zeros_like(scores).scatter(1, scores.topk(TOP_K).indices, 1.0)
    fraction = picked.sum(0) / (logits.shape[0] * TOP_K)
    aux = AUX_COEFF * EXPERTS * (fraction * scores.mean(0)).sum()
    z = Z_COEFF * torch.logsumexp(logits, -1).square().mean()
    (aux + z).backward()
    return w.grad


class AuxOnlyModule(L.LightningModule):
    """One MoE layer; the main loss has zero gradient, so router gradients are the aux losses'."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = _layer()
        self.batches: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.batches.append(x.detach().cpu().clone())
        return self.moe(x).float().sum() * 0.0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # weights stay put: one oracle weight


class RouterGrads(Callback):
    """The router-weight gradient the optimizer sees (unscaled by Lightning before this hook)."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []
        self.micro_batches: list[int] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append(pl_module.moe.router.weight.grad.detach().cpu().clone())
        self.micro_batches.append(len(pl_module.batches))


def _fp16_mixed() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))


def _trainer(tmp_path, callbacks, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0, default_root_dir=tmp_path, callbacks=callbacks,
        **kwargs,
    )


def _expected_step_grads(weight, batches, boundaries) -> list[torch.Tensor]:
    """Mean of the oracle over each step's micro-batches; ``boundaries`` = micro-batches seen per step."""
    out, start = [], 0
    for stop in boundaries:
        out.append(sum(aux_oracle_grad(weight, x) for x in batches[start:stop]) / (stop - start))
        start = stop
    return out


@pytest.mark.parametrize("precision", ["16-mixed", "32-true"])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_callback_scales_like_the_main_loss(tmp_path, precision, accumulate):
    module, grads = AuxOnlyModule(), RouterGrads()
    weight = module.moe.router.weight.detach().clone()
    plugins = [_fp16_mixed()] if precision == "16-mixed" else []
    trainer = _trainer(tmp_path, [MoELossScaling(), grads], plugins=plugins, max_steps=2,
                       accumulate_grad_batches=accumulate)
    trainer.fit(module, DataLoader(_dataset(BATCH * 2 * accumulate), batch_size=BATCH))
    assert grads.micro_batches == [accumulate, 2 * accumulate]
    expected = _expected_step_grads(weight, module.batches, grads.micro_batches)
    for got, want in zip(grads.grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_callback_follows_a_gradient_accumulation_schedule(tmp_path):
    """``GradientAccumulationScheduler`` changes ``accumulate_grad_batches`` between epochs."""
    module, grads = AuxOnlyModule(), RouterGrads()
    weight = module.moe.router.weight.detach().clone()
    schedule = GradientAccumulationScheduler({0: 1, 1: 2})
    trainer = _trainer(tmp_path, [MoELossScaling(), grads, schedule], plugins=[_fp16_mixed()], max_epochs=2)
    trainer.fit(module, DataLoader(_dataset(BATCH * 2), batch_size=BATCH))  # 2 micro-batches per epoch
    assert grads.micro_batches == [1, 2, 4]
    expected = _expected_step_grads(weight, module.batches, grads.micro_batches)
    for got, want in zip(grads.grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_without_scaling_a_trained_moe_layer_warns_once(tmp_path):
    """Two routed losses, two steps: one warning under Python's default filter (what users see)."""
    module = AuxOnlyModule()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")
        _trainer(tmp_path, [], max_steps=2).fit(module, DataLoader(_dataset(BATCH * 2), batch_size=BATCH))
    assert sum(str(w.message) == UNMANAGED_SCALE_WARNING for w in record) == 1
    assert "MoELossScaling" in UNMANAGED_SCALE_WARNING and "set_aux_loss_scale" in UNMANAGED_SCALE_WARNING


def test_an_explicit_scale_silences_the_warning(recwarn):
    layer = _layer()
    set_aux_loss_scale(layer, 1.0)
    layer(torch.randn(BATCH, SEQ, HIDDEN)).sum().backward()
    assert not [w for w in recwarn if str(w.message) == UNMANAGED_SCALE_WARNING]


def _strategy_run(rank: int, world: int, accumulate: int, with_callback: bool) -> dict:
    module, grads = AuxOnlyModule(), RouterGrads()
    weight = module.moe.router.weight.detach().clone()
    callbacks = [grads, MoELossScaling()] if with_callback else [grads]
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=MoEStrategy(expert_parallel_size=2), plugins=[_fp16_mixed()],
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, max_steps=2, accumulate_grad_batches=accumulate, callbacks=callbacks,
    )
    trainer.fit(module, DataLoader(_dataset(BATCH * world * 2 * accumulate), batch_size=BATCH))
    return {"weight": weight, "batches": module.batches, "grads": grads.grads, "micro": grads.micro_batches}


@pytest.mark.distributed
@pytest.mark.parametrize(("accumulate", "with_callback"), [(2, False), (1, True)])
def test_moe_strategy_scales_by_itself(tmp_path, accumulate, with_callback):
    """At EP=2 over 2 ranks the dense router gradient is the mean over both ranks' micro-batches."""
    ranks = run_distributed(_strategy_run, 2, accumulate, with_callback, timeout_s=120, tmp_dir=tmp_path)
    weight = ranks[0]["weight"]
    per_rank = [_expected_step_grads(weight, r["batches"], r["micro"]) for r in ranks]
    expected = [sum(step) / len(ranks) for step in zip(*per_rank)]
    for r in ranks:
        assert r["micro"] == [accumulate, 2 * accumulate]
        for got, want in zip(r["grads"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=GRAD_RTOL, atol=GRAD_ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["auto", "moe"])
def test_16_mixed_aux_gradients_on_a_gpu_match_fp32(tmp_path, strategy):
    """CUDA ``16-mixed`` (Lightning's own GradScaler): aux/z gradients equal the fp32 oracle."""
    module, grads = AuxOnlyModule(), RouterGrads()
    weight = module.moe.router.weight.detach().clone()
    callbacks = [grads] if strategy == "moe" else [grads, MoELossScaling()]
    trainer = L.Trainer(
        accelerator="gpu", devices=1, precision="16-mixed", max_steps=2, accumulate_grad_batches=2,
        strategy=MoEStrategy(process_group_backend="nccl") if strategy == "moe" else "auto",
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, default_root_dir=tmp_path, callbacks=callbacks,
    )
    trainer.fit(module, DataLoader(_dataset(BATCH * 4), batch_size=BATCH))
    expected = _expected_step_grads(weight, module.batches, grads.micro_batches)
    assert trainer.precision_plugin.scaler.get_scale() >= 2.0**10  # the loss really was scaled
    for got, want in zip(grads.grads, expected, strict=True):
        # fp32 router on the GPU against the CPU oracle: summation order and libm differences only.
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
