"""Selective recompute (`lightning_moe.memory.recompute`, `callbacks.SelectiveRecompute`).

Oracle: the same model without recompute. Losses, every gradient and every buffer (router token
counts, global aux-loss statistics, logged losses, metric statistics) after each of two steps
equal the plain run, for each recompute module and their combination, on the reference
`MoETransformer` and on a bare `MoELayer` ([B, S, H] with padding, and flat [T, H]). Router side
effects are recorded once (a plain non-reentrant checkpoint would count twice: checked too).
Saved bytes are counted with saved-tensor hooks: `moe_act` cuts the expert part by exactly the
activation output (N x F elements), the norms keep only their input with `layernorm`.
"""

from __future__ import annotations

import copy
import warnings
import weakref

import lightning as L
import pytest
import torch
from helpers.asserts import exceeds, worst_error
from torch.utils.checkpoint import checkpoint

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.callbacks import SelectiveRecompute
from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.memory import (
    RECOMPUTE_MODULES,
    SavedTensorCounter,
    apply_activation_offload,
    apply_selective_recompute,
)
from lightning_moe.models import MoETransformer, MoETransformerConfig

# fp32 tolerances of docs/architecture.md §9. Recompute reorders nothing except the activation's
# backward (recomputed from the fc1 output instead of read back), a few ulps.
OUT_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
VOCAB, HIDDEN, FFN, EXPERTS, TOP_K, BATCH, SEQ = 64, 32, 16, 4, 2, 2, 12


def moe_config(**overrides) -> MoEConfig:
    fields = dict(
        hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=EXPERTS, top_k=TOP_K,
        shared_expert_ffn_hidden_size=16, score_func="sigmoid", expert_bias=True,
        load_balancing=["aux_loss", "global_aux_loss"], aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
        input_jitter_eps=1e-2, init_std=0.2,
    )
    fields.update(overrides)
    return MoEConfig(**fields)


def transformer(**overrides) -> MoETransformer:
    torch.manual_seed(3)
    model = MoETransformer(MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=2, num_attention_heads=4, num_kv_heads=2,
        ffn_hidden_size=64, max_seq_len=32, qk_norm=True, moe=moe_config(**overrides),
    ))
    keep_activation(model)
    return model


def keep_activation(model: torch.nn.Module) -> None:
    """Baseline keeps the activation output (the CPU default recomputes it)."""
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.recompute_activation = False


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def train_steps(model: torch.nn.Module, batches, loss_fn) -> list[dict]:
    """Two steps of SGD; per step the loss, a copy of every gradient and of every buffer."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records = []
    for step, batch in enumerate(batches):
        torch.manual_seed(100 + step)  # router jitter draws from the global RNG
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        records.append({
            "loss": loss.detach().clone(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
        })
        optimizer.step()
        for module in model.modules():  # consumer of the expert-bias counts, as the callback does
            if hasattr(module, "local_tokens_per_expert"):
                module.local_tokens_per_expert.zero_()
    return records


def lm_loss(model, batch):
    return model.loss(batch[:, :-1], batch[:, 1:])


def assert_same_run(got: list[dict], want: list[dict]) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g["loss"], w["loss"], **OUT_TOL, msg=f"loss, step {step}")
        assert g["grads"].keys() == w["grads"].keys()
        for name in w["grads"]:
            torch.testing.assert_close(g["grads"][name], w["grads"][name], **GRAD_TOL,
                                       msg=f"grad of {name}, step {step}")
        assert g["buffers"].keys() == w["buffers"].keys()
        for name, buffer in w["buffers"].items():
            if buffer.is_floating_point():
                torch.testing.assert_close(g["buffers"][name], buffer, **OUT_TOL, msg=f"{name}, step {step}")
            else:  # token counts, steps: exact
                assert torch.equal(g["buffers"][name], buffer), f"{name}, step {step}"


COMBINATION = ["moe_act", "layernorm", "shared_experts", "router", "core_attn", "attention", "moe"]


@pytest.mark.parametrize("modules", [[m] for m in RECOMPUTE_MODULES] + [COMBINATION],
                         ids=[*RECOMPUTE_MODULES, "all"])
def test_transformer_losses_gradients_and_buffers_equal_the_plain_run(modules):
    base = transformer()
    batches = [tokens(1), tokens(2)]
    want = train_steps(copy.deepcopy(base), batches, lm_loss)
    model = copy.deepcopy(base)
    handle = apply_selective_recompute(model, modules)
    assert all(handle.modules[m] for m in modules), handle.modules
    assert_same_run(train_steps(model, batches, lm_loss), want)
    assert want[0]["buffers"]["layers.0.ffn.router.local_tokens_per_expert"].sum() == BATCH * SEQ * TOP_K


def _layer_loss(model, batch):
    hidden, mask = batch
    return (model(hidden, padding_mask=mask) ** 2).mean()


@pytest.mark.parametrize("flat", [False, True], ids=["BSH-padded", "TH"])
@pytest.mark.parametrize("modules", [["moe_act"], ["shared_experts"], ["router"], ["moe"], ["moe", "router"]],
                         ids=["moe_act", "shared_experts", "router", "moe", "moe+router"])
def test_moe_layer_equals_the_plain_run(modules, flat):
    torch.manual_seed(4)
    base = MoELayer(moe_config())
    keep_activation(base)
    gen = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(2):
        hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
        mask = torch.zeros(BATCH, SEQ, dtype=torch.bool)
        mask[:, -2:] = True
        batches.append((hidden.reshape(-1, HIDDEN), None) if flat else (hidden, mask))
    want = train_steps(copy.deepcopy(base), batches, _layer_loss)
    layer = copy.deepcopy(base)
    apply_selective_recompute(layer, modules)
    assert_same_run(train_steps(layer, batches, _layer_loss), want)


def test_plain_non_reentrant_checkpoint_would_count_twice():
    """The oracle of the side-effect handling: torch's checkpoint alone double counts."""
    torch.manual_seed(4)
    layer = MoELayer(moe_config(input_jitter_eps=None))
    hidden = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    original = layer.forward
    layer.forward = lambda h: checkpoint(original, h, use_reentrant=False)
    layer(hidden).sum().backward()
    assert layer.router.local_tokens_per_expert.sum() == 2 * BATCH * SEQ * TOP_K
    del layer.forward
    layer.router.local_tokens_per_expert.zero_()
    apply_selective_recompute(layer, ["moe"])
    layer(hidden).sum().backward()
    assert layer.router.local_tokens_per_expert.sum() == BATCH * SEQ * TOP_K


def _counted(layer: MoELayer, hidden: torch.Tensor) -> dict[str, int]:
    counter = SavedTensorCounter(exclude=layer)
    handles = counter.track({"experts": layer.experts, "router": layer.router})
    with counter:
        out = layer(hidden)
    counted = counter.saved_bytes()
    out.sum().backward()
    for handle in handles:
        handle.remove()
    return counted


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
def test_moe_act_cuts_the_expert_part_by_the_activation_output(kernel, aten_gemms):
    torch.manual_seed(4)
    layer = MoELayer(moe_config(shared_expert_ffn_hidden_size=None), expert_kernel=kernel)
    keep_activation(layer)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    before = _counted(layer, hidden)
    apply_selective_recompute(layer, ["moe_act"])
    after = _counted(layer, hidden)
    n_rows = BATCH * SEQ * TOP_K
    activation_output = n_rows * FFN * 4  # N x F fp32
    fc1_output = n_rows * 2 * FFN * 4  # stays saved
    if kernel == "loop":  # exactly the activation output
        assert before["experts"] - after["experts"] == activation_output
    else:  # the autograd path also keeps silu(gate) and the fc2 input: three N x F tensors go
        assert before["experts"] - after["experts"] == 3 * activation_output
    assert after["experts"] >= fc1_output
    assert after["router"] == before["router"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_mm_activation_recompute_equals_autograd(dtype):
    torch.manual_seed(6)
    plain = GroupedExperts(EXPERTS, HIDDEN, FFN, "swiglu", fc2_bias=True, kernel="grouped_mm")
    plain.reset_parameters(layer_seed=1, std=0.2)
    plain.recompute_activation = False
    recomputing = copy.deepcopy(plain)
    recomputing.recompute_activation = True
    counts = [8, 0, 16, 8]  # multiples of 8 rows (CPU grouped_mm alignment), one empty expert
    x = torch.randn(sum(counts), HIDDEN).to(dtype)
    probs = torch.rand(sum(counts))
    results = []
    for experts in (plain.to(dtype), recomputing.to(dtype)):
        xx, pp = x.clone().requires_grad_(), probs.clone().requires_grad_()
        out = experts(xx, counts, pp)
        out.backward(torch.ones_like(out))
        results.append((out, xx.grad, pp.grad, *(p.grad for p in experts.parameters())))
    tol = OUT_TOL if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got.float(), want.float(), **tol)


def test_layernorm_keeps_only_the_norm_input_and_frees_its_output():
    model = transformer()
    apply_selective_recompute(model, ["layernorm"])
    block = model.layers[0]
    outputs = []
    block.attn_norm.register_forward_hook(lambda m, a, out: outputs.append(out.untyped_storage()))
    counter = SavedTensorCounter(exclude=model)
    counter.track({"attn_norm": block.attn_norm, "ffn_norm": block.ffn_norm})
    batch = tokens(1)
    with counter:
        loss = lm_loss(model, batch)
    saved = counter.saved_bytes()
    token_bytes = BATCH * SEQ * HIDDEN * 4
    assert saved["attn_norm"] == token_bytes  # its input, nothing else
    assert saved["ffn_norm"] == token_bytes
    storage = outputs[0]
    outputs.clear()
    alive = weakref.ref(storage)
    del storage
    assert alive() is None, "the attention norm's output must be released after the block's forward"
    loss.backward()


def test_module_hooks_still_run_around_a_recomputed_module():
    """Tensor parallelism converts inputs/outputs in forward hooks of the MoE layer: they stay outside."""
    torch.manual_seed(4)
    base = MoELayer(moe_config(input_jitter_eps=None))
    hidden = torch.randn(BATCH, SEQ, HIDDEN)
    runs = []
    for recompute in (False, True):
        layer = copy.deepcopy(base)
        calls = []
        layer.register_forward_pre_hook(lambda m, args, calls=calls: (calls.append("pre"), (args[0] * 2,))[1])
        layer.register_forward_hook(lambda m, args, out, calls=calls: (calls.append("post"), out + 1)[1])
        if recompute:
            apply_selective_recompute(layer, ["moe"])
        x = hidden.clone().requires_grad_()
        out = layer(x)
        out.square().sum().backward()
        assert calls == ["pre", "post"]
        runs.append((out, x.grad, layer.router.weight.grad))
    for got, want in zip(runs[1], runs[0]):
        torch.testing.assert_close(got, want, **GRAD_TOL)


def test_evaluation_without_grad_runs_plainly_and_records_nothing():
    model = transformer()
    apply_selective_recompute(model, COMBINATION)
    model.eval()
    with torch.no_grad():
        logits = model(tokens(1)[:, :-1])
    assert logits.shape == (BATCH, SEQ, VOCAB)
    assert model.layers[0].ffn.router.local_tokens_per_expert.sum() == 0


def test_double_backward_with_retained_graph():
    model = transformer()
    apply_selective_recompute(model, ["layernorm", "moe"])
    reference = transformer()
    for m in (model, reference):
        torch.manual_seed(7)
        loss = lm_loss(m, tokens(1))
        loss.backward(retain_graph=True)
        loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **GRAD_TOL, msg=name)


def test_remove_restores_every_module():
    model = transformer()
    handle = apply_selective_recompute(model, COMBINATION)
    assert handle.modules["layernorm"] == ["layers.0.attn_norm", "layers.0.ffn_norm",
                                           "layers.1.attn_norm", "layers.1.ffn_norm"]
    assert model.layers[0].ffn.experts.recompute_activation is True
    handle.remove()
    for module in model.modules():
        assert "forward" not in module.__dict__
        assert not hasattr(module, "_lightning_moe_recompute")
        assert not module._forward_pre_hooks and not module._forward_hooks
    assert model.layers[0].ffn.experts.recompute_activation is False
    apply_selective_recompute(model, ["moe"]).remove()  # applicable again


def test_errors():
    model = transformer()
    with pytest.raises(ValueError, match=r"Unknown recompute module\(s\) \['mlp'\]; choose from"):
        apply_selective_recompute(model, ["moe_act", "mlp"])
    apply_selective_recompute(model, ["moe"])
    with pytest.raises(ValueError, match=r"layers.0.ffn is already recomputed \('moe'\)"):
        apply_selective_recompute(model, ["moe"])
    with pytest.raises(ValueError, match=r"Cannot offload 'expert_fc1' at layers.0.ffn.experts: .* recomputed \('moe'\)"):
        apply_activation_offload(model, ["expert_fc1"])
    other = transformer()
    apply_activation_offload(other, ["core_attn"])
    with pytest.raises(ValueError, match=r"Cannot recompute 'attention' \(layers.0.attn\): activation offload "
                                         r"'core_attn' is installed inside it"):
        apply_selective_recompute(other, ["attention"])
    assert "forward" not in other.layers[0].attn.__dict__  # a failed application leaves nothing behind


# ---------------------------------------------------------------------------------- the callback


class _LitTransformer(L.LightningModule):
    def __init__(self, model: MoETransformer) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        torch.manual_seed(100 + batch_idx)
        return lm_loss(self.model, batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(model: MoETransformer, callbacks: list) -> MoETransformer:
    data = torch.utils.data.TensorDataset(torch.stack([tokens(i)[0] for i in range(4)]))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    lit = _LitTransformer(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers).*")
        trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=2))
    return lit.model


def test_callback_trains_like_the_plain_run_and_cleans_up():
    base = transformer()
    want = _fit(copy.deepcopy(base), [])
    callback = SelectiveRecompute(modules=["moe_act", "layernorm", "router"])
    got = _fit(copy.deepcopy(base), [callback])
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(p, q, **GRAD_TOL, msg=name)
    for module in got.modules():  # teardown undid everything
        assert "forward" not in module.__dict__
    with pytest.raises(ValueError, match="Unknown recompute module"):
        SelectiveRecompute(modules=["everything"])


# ------------------------------------------------------------------ tensor x expert parallel (2 ranks)


def _parallel_run_equals_plain(rank: int, world: int, recompute: list[str], offload: list[str]) -> dict[str, float]:
    from torch.distributed.tensor import DTensor

    from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize

    torch.manual_seed(0)
    config = MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=2, num_attention_heads=4, num_kv_heads=2,
        ffn_hidden_size=64, qk_norm=True, moe=moe_config(input_jitter_eps=None),
    )
    plain = MoETransformer(config)
    model = copy.deepcopy(plain)
    ctx = build_parallel_context(ParallelDims(world, tp=2, etp=1, ep=2), "cpu")
    for m in (plain, model):
        parallelize(m, ctx)
        keep_activation(m)
    if recompute:
        apply_selective_recompute(model, recompute)
    if offload:
        apply_activation_offload(model, offload, min_tensor_bytes=0)
    worst: dict[str, float] = {}

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    for step in range(2):
        batch = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(10 + step))
        losses = []
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            loss = lm_loss(m, batch)
            loss.backward()
            losses.append(loss.detach())
        worst["loss"] = worst_error(worst.get("loss", 0.0), (losses[0] - losses[1]).abs().item())
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            err = (local(p.grad) - local(q.grad)).abs().max().item()
            worst[name] = worst_error(worst.get(name, 0.0), err)
        for (name, b), c in zip(model.named_buffers(), plain.buffers()):
            if not b.is_floating_point():
                worst[name] = worst_error(worst.get(name, 0.0), float((b != c).sum()))
    for i in (0, 1):  # dispatcher byte counters: one forward dispatch per micro-batch, recompute not counted
        got, want = model.layers[i].ffn.dispatcher.stats, plain.layers[i].ffn.dispatcher.stats
        assert want.dispatches == 2 and want.dispatch_bytes > 0
        for field in ("dispatch_bytes", "combine_bytes", "rows_sent", "dispatches"):
            worst[f"layers.{i} {field}"] = float(abs(getattr(got, field) - getattr(want, field)))
    return worst


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("recompute", "offload"),
    [(["moe", "layernorm", "attention"], []),
     (["moe_act", "layernorm", "router", "shared_experts", "core_attn"], ["expert_fc1", "moe_act", "attn_proj"])],
    ids=["moe+layernorm+attention", "fine-grained+offload"],
)
def test_tensor_and_expert_parallel_runs_equal_the_plain_parallel_run(recompute, offload, tmp_path):
    """TP=2 x EP=2 folded: the MoE layer's TP hooks (local sequence slice in, sequence-sharded out)
    stay outside the recomputed region, and the all-to-all is redone in backward."""
    from helpers.dist import run_distributed

    results = run_distributed(_parallel_run_equals_plain, 2, recompute, offload, timeout_s=180, tmp_dir=tmp_path)
    failures = {f"rank {r}: {k}": v for r, worst in enumerate(results) for k, v in worst.items() if exceeds(v, 1e-5)}
    assert not failures, failures
