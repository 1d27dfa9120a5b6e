"""Selective recompute and activation offload on a user's own model (``memory/user_model.py``).

The model has its own attention module, ``torch.nn.LayerNorm`` s and two ``lightning_moe.MoELayer`` s,
and none of the reference model's names. Trained through ``Trainer.fit`` on CPU:

* at the callbacks' defaults (``moe_act`` / ``expert_fc1``, found by the package's expert type)
  nothing is unmatched, nothing crashes;
* names that match nothing warn once, naming each name and what it looks for (``strict=True``
  raises instead);
* with ``targets=`` the user's own modules are recomputed / offloaded: the saved-activation bytes
  of exactly those modules drop (``SavedTensorCounter``, per region), and losses and every
  gradient equal the run without the callback (the oracle).
"""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from memory.user_model import HIDDEN, SEQ, UserModel, fit_user
from torch import nn

from lightning_moe.callbacks import ActivationOffload, SelectiveRecompute
from lightning_moe.memory import apply_activation_offload, apply_selective_recompute

OUT_TOL = dict(rtol=1e-5, atol=1e-6)  # fp32: recompute and offload reorder nothing
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
BATCH, FP32 = 2, 4
ACTIVATION = BATCH * SEQ * HIDDEN * FP32  # one [B, S, H] fp32 activation
NORM_STATS = 2 * BATCH * SEQ * FP32  # LayerNorm's saved mean and rstd, [B, S, 1] each


def assert_same_run(got, want) -> None:
    """Losses and every gradient of every step equal (``UserLM`` records)."""
    assert len(got.losses) == len(want.losses) == len(got.grads) == len(want.grads) > 0
    for loss, want_loss in zip(got.losses, want.losses):
        torch.testing.assert_close(loss, want_loss, **OUT_TOL)
    for grads, want_grads in zip(got.grads, want.grads):
        assert grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            torch.testing.assert_close(grads[name], grad, **GRAD_TOL, msg=name)


class AppliedProbe(L.Callback):
    """Reads what a memory callback applied, and its offload statistics, at the end of training."""

    def __init__(self, callback) -> None:
        self.callback = callback
        self.applied: dict[str, list[str]] = {}
        self.offloaded: dict[str, int] = {}
        self.kept_groups = 0

    def on_train_end(self, trainer, pl_module) -> None:
        self.applied = dict(self.callback.applied)
        stats = getattr(self.callback, "stats", None)
        if stats is not None:
            self.offloaded = dict(stats.offloaded_bytes_by_name)
            self.kept_groups = stats.kept_groups


def unmatched_warnings(messages: list[str], feature: str) -> list[str]:
    return [m for m in messages if m.startswith(feature) and "matched no module" in m]


@functools.cache
def plain_run(**trainer_kwargs):
    """The run without memory callbacks, saved bytes counted (the oracle; deterministic, so shared)."""
    return fit_user([], count_saved=True, **trainer_kwargs)[0]


def fit_against_plain(callback, **trainer_kwargs):
    """Fit with ``callback`` (and an `AppliedProbe` of it), saved bytes counted, and check it against the plain run.

    Every such run must match all its names (no unmatched-name warning) and give the plain run's
    losses and gradients. Returns ``(got, plain, probe, messages)``.
    """
    plain = plain_run(**trainer_kwargs)
    probe = AppliedProbe(callback)
    got, messages = fit_user([callback, probe], count_saved=True, **trainer_kwargs)
    assert not unmatched_warnings(messages, type(callback).__name__), messages
    assert_same_run(got, plain)
    return got, plain, probe, messages


# ------------------------------------------------------------------------------- selective recompute


def test_recompute_defaults_run_and_unmatched_names_warn_once_with_what_they_match():
    callback = SelectiveRecompute()
    _, messages = fit_user([callback])
    assert not unmatched_warnings(messages, "SelectiveRecompute"), messages
    callback = SelectiveRecompute(modules=["moe_act", "layernorm", "attention", "core_attn"])
    _, messages = fit_user([callback])
    (message,) = unmatched_warnings(messages, "SelectiveRecompute")
    assert "['layernorm', 'attention', 'core_attn'] matched no module of UserLM" in message, message
    assert "'layernorm': norms named attn_norm / ffn_norm" in message, message
    assert "'attention': the attention modules a model's parallel_plan() declares" in message, message
    assert "'core_attn': the core-attention modules a model's parallel_plan() declares" in message, message
    assert "targets={'layernorm': [...], 'attention': [...], 'core_attn': [...]}" in message, message
    assert "moe_act" not in message.split("matched no module")[0]  # found: the experts of both MoELayers


def test_recompute_strict_raises_for_unmatched_names():
    with pytest.raises(ValueError, match=r"SelectiveRecompute: \['attention'\] matched no module of UserLM.*"
                                         r"'attention': the attention modules a model's parallel_plan\(\) declares"):
        fit_user([SelectiveRecompute(modules=["moe_act", "attention"], strict=True)])


def test_recompute_of_the_users_own_norms_and_attention_equals_the_plain_run_and_saves_their_bytes():
    callback = SelectiveRecompute(
        modules=["moe_act", "layernorm", "attention"],
        targets={"layernorm": [nn.LayerNorm], "attention": ["blocks.*.attn"]},
    )
    got, plain, probe, _ = fit_against_plain(callback)
    assert probe.applied["layernorm"] == [
        "net.blocks.0.norm1", "net.blocks.0.norm2", "net.blocks.1.norm1", "net.blocks.1.norm2", "net.norm",
    ]
    assert probe.applied["attention"] == ["net.blocks.0.attn", "net.blocks.1.attn"]
    for saved, base in zip(got.saved, plain.saved, strict=True):
        for i in (0, 1):
            # Without recompute: the norm keeps its input, mean and rstd; the attention its input,
            # q/k/v, the attention output and statistics, the projection input.
            assert base[f"block{i}.norm1"] == ACTIVATION + NORM_STATS
            assert base[f"block{i}.attn"] > 3 * ACTIVATION
            # Output-discarding norms keep their input only; the attention keeps only its input,
            # which is the discarded norm output (recomputed in backward): nothing.
            assert saved[f"block{i}.norm1"] == saved[f"block{i}.norm2"] == ACTIVATION
            assert saved.get(f"block{i}.attn", 0) == 0
        assert sum(saved.values()) < sum(base.values())


def test_recompute_of_the_users_modules_under_cpu_bf16_autocast_equals_the_plain_run():
    plain, _ = fit_user([], precision="bf16-mixed")
    callback = SelectiveRecompute(
        modules=["layernorm", "attention"], targets={"layernorm": [nn.LayerNorm], "attention": ["attn"]},
    )
    got, _ = fit_user([callback], precision="bf16-mixed")
    assert_same_run(got, plain)  # the recomputation re-enters the forward's autocast state


def test_recompute_targets_are_checked():
    with pytest.raises(ValueError, match=r"targets for 'moe_act'.*found by type.*accept targets: "
                                         r"\['layernorm', 'core_attn', 'attention'\]"):
        SelectiveRecompute(modules=["moe_act"], targets={"moe_act": [nn.Linear]})
    with pytest.raises(ValueError, match=r"targets for 'attention', which is not in modules \['layernorm'\]"):
        SelectiveRecompute(modules=["layernorm"], targets={"attention": ["attn"]})
    with pytest.raises(TypeError, match=r"targets\['layernorm'\] entries must be nn\.Module subclasses or "
                                        r"qualified-name patterns, got 3 \(int\)"):
        SelectiveRecompute(modules=["layernorm"], targets={"layernorm": [3]})
    with pytest.raises(ValueError, match=r"targets\['attention'\] has an empty pattern"):
        apply_selective_recompute(UserModel(), ["attention"], targets={"attention": [""]})
    with pytest.raises(ValueError, match=r"blocks\.0\.norm1 is already recomputed \('layernorm'\)"):
        apply_selective_recompute(UserModel(), ["layernorm", "attention"],
                                  targets={"layernorm": [nn.LayerNorm], "attention": [nn.LayerNorm]})
    model = UserModel()
    handle = apply_selective_recompute(model, ["attention"], targets={"attention": "blocks.*.attn"})  # one spec
    assert handle.modules == {"attention": ["blocks.0.attn", "blocks.1.attn"]}
    handle.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())
    handle = apply_selective_recompute(model, ["attention"], targets={"attention": ["nothing.here", nn.GRU]})
    assert "'attention': your targets ['nothing.here', GRU]" in handle.unmatched_message("caller", "UserModel")
    with pytest.raises(ValueError, match=r"apply_selective_recompute: \['layernorm'\] matched no module of "
                                         r"UserModel.*Raised because strict=True"):
        apply_selective_recompute(model, ["moe_act", "layernorm"], strict=True)
    assert all(not getattr(m, "recompute_activation", False) for m in model.modules())  # nothing changed


# -------------------------------------------------------------------------------- activation offload


def test_offload_defaults_run_and_unmatched_names_warn_once_with_what_they_match():
    _, messages = fit_user([ActivationOffload()])
    assert not unmatched_warnings(messages, "ActivationOffload"), messages
    assert sum("saves no memory" in m for m in messages) == 1, messages
    callback = ActivationOffload(modules=["expert_fc1", "attn_norm", "qkv_linear", "core_attn", "mlp_norm"])
    _, messages = fit_user([callback])
    (message,) = unmatched_warnings(messages, "ActivationOffload")
    assert "['attn_norm', 'qkv_linear', 'core_attn', 'mlp_norm'] matched no module of UserLM" in message, message
    assert "'attn_norm': modules named attn_norm" in message, message
    assert "'qkv_linear': the q_proj / k_proj / v_proj (MLA: q_proj or q_down_proj, kv_down_proj) of modules named attn" in message, message
    assert "'core_attn': modules named core_attn inside modules named attn" in message, message
    assert "'mlp_norm': modules named ffn_norm" in message, message
    assert "targets={'attn_norm': [...], 'qkv_linear': [...], 'core_attn': [...], 'mlp_norm': [...]}" in message


def test_offload_strict_raises_for_unmatched_names():
    with pytest.raises(ValueError, match=r"ActivationOffload: \['attn_proj'\] matched no module of UserLM.*"
                                         r"'attn_proj': modules named o_proj inside modules named attn"):
        fit_user([ActivationOffload(modules=["expert_fc1", "attn_proj"], strict=True)])


def test_offload_of_the_users_own_modules_equals_the_plain_run_and_moves_their_bytes():
    callback = ActivationOffload(
        modules=["attn_norm", "qkv_linear", "attn_proj", "mlp_norm", "expert_fc1"],
        targets={"attn_norm": ["norm1"], "qkv_linear": ["attn.qkv"], "attn_proj": ["blocks.*.attn.proj"],
                 "mlp_norm": [nn.LayerNorm]},
        min_tensor_bytes=0,
    )
    with pytest.raises(ValueError, match=r"net\.blocks\.0\.norm1 \(LayerNorm\) already has an activation "
                                         r"offload boundary \('attn_norm'\).*'mlp_norm'"):
        fit_user([callback])  # nn.LayerNorm matches norm1 too: one boundary per module
    callback = ActivationOffload(
        modules=["attn_norm", "qkv_linear", "attn_proj", "mlp_norm", "expert_fc1"],
        targets={"attn_norm": ["norm1"], "qkv_linear": ["attn.qkv"], "attn_proj": ["blocks.*.attn.proj"],
                 "mlp_norm": ["blocks.*.norm2"]},
        min_tensor_bytes=0,
    )
    got, plain, probe, _ = fit_against_plain(callback)
    assert probe.applied == {
        "attn_norm": ["net.blocks.0.norm1", "net.blocks.1.norm1"],
        "qkv_linear": ["net.blocks.0.attn.qkv_linear", "net.blocks.1.attn.qkv_linear"],
        "attn_proj": ["net.blocks.0.attn.proj", "net.blocks.1.attn.proj"],
        "mlp_norm": ["net.blocks.0.norm2", "net.blocks.1.norm2"],
        "expert_fc1": ["net.blocks.0.moe.experts", "net.blocks.1.moe.experts"],
    }
    steps = len(got.losses)
    # Every layer but the last (warm-up rule) moves what the boundary saves, every step:
    # norms their input + mean + rstd, qkv and proj their input ([B, S, H] each).
    assert probe.offloaded["attn_norm"] == probe.offloaded["mlp_norm"] == steps * (ACTIVATION + NORM_STATS)
    assert probe.offloaded["qkv_linear"] == probe.offloaded["attn_proj"] == steps * ACTIVATION
    assert probe.offloaded["expert_fc1"] > 0
    assert probe.kept_groups == steps * 5
    for saved, base in zip(got.saved, plain.saved, strict=True):
        # Offloaded storages left the "device" (on CPU: their last reference was dropped after the copy).
        assert saved.get("block0.norm1", 0) == 0 and base["block0.norm1"] == ACTIVATION + NORM_STATS
        assert saved["block1.norm1"] == base["block1.norm1"]  # the last layer's group stays
        assert sum(saved.values()) < sum(base.values())


def test_offload_targets_are_checked():
    with pytest.raises(ValueError, match=r"targets for 'expert_fc1'.*found by type.*accept targets: "
                                         r"\['attn_norm', 'qkv_linear', 'core_attn', 'attn_proj', 'mlp_norm'\]"):
        ActivationOffload(modules=["expert_fc1"], targets={"expert_fc1": [nn.Linear]})
    with pytest.raises(ValueError, match=r"targets for 'core_attn', which is not in modules \['attn_norm'\]"):
        apply_activation_offload(UserModel(), ["attn_norm"], targets={"core_attn": ["attn"]})
    model = UserModel()
    with pytest.raises(ValueError, match=r"apply_activation_offload: \['mlp_norm'\] matched no module of "
                                         r"UserModel.*Raised because strict=True"):
        apply_activation_offload(model, ["expert_fc1", "mlp_norm"], strict=True)
    assert all(not hasattr(m, "_lightning_moe_offload") for m in model.modules())  # nothing installed
    recompute = apply_selective_recompute(model, ["attention"], targets={"attention": ["attn"]})
    with pytest.raises(ValueError, match=r"Cannot offload 'attn_proj' at blocks\.0\.attn\.proj: it is inside "
                                         r"blocks\.0\.attn, which is recomputed \('attention'\)"):
        apply_activation_offload(model, ["attn_proj"], targets={"attn_proj": ["attn.proj"]})
    recompute.remove()


@pytest.mark.gpu
def test_gpu_offload_of_the_users_own_modules_returns_the_same_gradients_and_frees_their_storages():
    callback = ActivationOffload(
        modules=["attn_norm", "qkv_linear", "attn_proj", "mlp_norm", "expert_fc1"],
        targets={"attn_norm": ["norm1"], "qkv_linear": ["attn.qkv"], "attn_proj": ["attn.proj"],
                 "mlp_norm": ["norm2"]},
        min_tensor_bytes=0,
    )
    got, plain, probe, messages = fit_against_plain(callback, accelerator="gpu")
    assert not any("saves no memory" in m for m in messages)
    steps = len(got.losses)
    assert probe.offloaded["attn_norm"] == probe.offloaded["mlp_norm"] == steps * (ACTIVATION + NORM_STATS)
    assert probe.offloaded["qkv_linear"] == probe.offloaded["attn_proj"] == steps * ACTIVATION
    for saved, base in zip(got.saved, plain.saved, strict=True):
        # The device copies were released after the copies to pinned host memory.
        assert saved.get("block0.norm1", 0) == 0 and base["block0.norm1"] == ACTIVATION + NORM_STATS
        assert sum(saved.values()) < sum(base.values())


def test_each_callback_runs_on_the_shared_user_project_model():
    """``helpers/user_model.py`` (another user-style model: its own LayerNorm class, AdamW, a DataModule)."""
    from helpers.user_model import LayerNorm, RandomTokenDataModule, UserMoELM

    from lightning_moe.callbacks import CUDAGraphCapture

    recompute = SelectiveRecompute(modules=["moe_act", "layernorm"], targets={"layernorm": [LayerNorm]})
    offload = ActivationOffload(modules=["expert_fc1", "attn_norm"], targets={"attn_norm": ["ln1"]})
    graphs = CUDAGraphCapture()
    probes = [AppliedProbe(recompute), AppliedProbe(offload)]
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[recompute, offload, graphs, *probes],
    )
    with pytest.warns(UserWarning, match=r"scope 'attn' found nothing to capture in UserMoELM"):
        trainer.fit(UserMoELM(), RandomTokenDataModule(num_samples=8))
    assert probes[0].applied["layernorm"] == ["blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_f"]
    assert probes[1].applied["attn_norm"] == ["blocks.0.ln1", "blocks.1.ln1"]
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
