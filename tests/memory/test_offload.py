"""Activation offload (`lightning_moe.memory.offload`, `callbacks.ActivationOffload`).

CPU (the same code path with synchronous copies): losses and every gradient equal the run without
offload for each boundary, all of them, and all of them with `moe_act` + `layernorm` recompute,
on the reference `MoETransformer` and on a stack of bare `MoELayer` s; the bytes moved are exactly
the boundary's saved storages of every layer but the last (the warm-up rule keeps the group needed
first in backward on the device): analytic sizes for `expert_fc1`, `moe_act`, `qkv_linear` and
`attn_proj`, the saved-tensor counter's bytes of the boundary module for the others; reloads run
one group ahead in backward order, none on demand; the callback warns once on CPU.
GPU (marked ``gpu``): copies run on side streams into pinned memory and overlap with compute
issued after them; gradients equal the run without offload.
"""

from __future__ import annotations

import copy
import warnings
from contextlib import nullcontext

import lightning as L
import pytest
import torch
from torch import nn

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.callbacks import ActivationOffload
from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.memory import (
    OFFLOAD_MODULES,
    ActivationOffloader,
    SavedTensorCounter,
    apply_activation_offload,
    apply_selective_recompute,
)
from lightning_moe.models import MoETransformer, MoETransformerConfig

OUT_TOL = dict(rtol=1e-5, atol=1e-6)  # docs/architecture.md §9, fp32
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
VOCAB, HIDDEN, HEADS, FFN, EXPERTS, TOP_K, BATCH, SEQ = 64, 32, 4, 16, 4, 2, 2, 12
TOKENS = BATCH * SEQ
FP32 = 4


def transformer(num_layers: int = 2, device: str = "cpu") -> MoETransformer:
    torch.manual_seed(3)
    model = MoETransformer(MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=num_layers, num_attention_heads=HEADS,
        num_kv_heads=2, ffn_hidden_size=64, max_seq_len=32, qk_norm=True,
        moe=MoEConfig(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=EXPERTS, top_k=TOP_K,
                      shared_expert_ffn_hidden_size=16, load_balancing=["aux_loss"], aux_loss_coeff=1e-2,
                      z_loss_coeff=1e-3, init_std=0.2),
    )).to(device)
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.recompute_activation = False  # baseline keeps the activation output
    return model


def tokens(seed: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed)).to(device)


def lm_loss(model, batch):
    return model.loss(batch[:, :-1], batch[:, 1:])


def run(model, batches, loss_fn=lm_loss, offloader=None) -> list[tuple[torch.Tensor, dict]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records = []
    for batch in batches:
        if offloader is not None:
            offloader.start_microbatch()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        records.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        optimizer.step()
    return records


def assert_same(got, want) -> None:
    for (loss, grads), (want_loss, want_grads) in zip(got, want, strict=True):
        torch.testing.assert_close(loss, want_loss, **OUT_TOL)
        for name, grad in want_grads.items():
            torch.testing.assert_close(grads[name], grad, **GRAD_TOL, msg=name)


ALL = list(OFFLOAD_MODULES)


@pytest.mark.parametrize(
    ("modules", "recompute"),
    [([m], []) for m in OFFLOAD_MODULES] + [(ALL, []), (ALL, ["moe_act", "layernorm"])],
    ids=[*OFFLOAD_MODULES, "all", "all+recompute"],
)
def test_transformer_equals_the_plain_run(modules, recompute):
    base = transformer()
    batches = [tokens(1), tokens(2)]
    want = run(copy.deepcopy(base), batches)
    model = copy.deepcopy(base)
    if recompute:
        apply_selective_recompute(model, recompute)
    handle = apply_activation_offload(model, modules, min_tensor_bytes=0)
    got = run(model, batches, offloader=handle.offloader)
    assert_same(got, want)
    stats = handle.offloader.stats
    per_step = len(modules)  # one group per boundary and layer; layer 0 offloaded, layer 1 kept
    assert stats.offloaded_groups == 2 * per_step
    assert stats.kept_groups == 2 * per_step
    assert stats.reloaded_bytes == stats.offloaded_bytes > 0
    assert stats.reloads_on_demand == 0


def _expected_bytes(model: MoETransformer, name: str) -> int:
    """Bytes one step offloads for ``name``: layer 0's group (layer 1's is kept)."""
    tokens_bytes = TOKENS * HIDDEN * FP32
    rows = TOKENS * TOP_K
    analytic = {
        "expert_fc1": tokens_bytes,  # the expert input (the layer's tokens: the permutation is fused)
        "moe_act": rows * (2 * FFN + FFN) * FP32,  # fc1 output [N, 2F] and activation output [N, F]
        "qkv_linear": tokens_bytes,  # the attention norm's output, saved once for q, k and v
        "attn_proj": tokens_bytes,  # o_proj's input [T, heads * D]
    }
    if name in analytic:
        return analytic[name]
    # The others: what the boundary module of layer 0 saves, counted with saved-tensor hooks.
    module = {"attn_norm": "layers.0.attn_norm", "mlp_norm": "layers.0.ffn_norm",
              "core_attn": "layers.0.attn.core_attn"}[name]
    counter = SavedTensorCounter(exclude=model)
    counter.track({name: model.get_submodule(module)})
    with counter:
        loss = lm_loss(model, tokens(1))
    saved = counter.saved_bytes()[name]
    loss.backward()
    return saved


@pytest.mark.parametrize("name", OFFLOAD_MODULES)
def test_offloaded_bytes_are_exactly_the_boundary_storages(name, aten_gemms):
    model = transformer()
    expected = _expected_bytes(copy.deepcopy(model), name)
    handle = apply_activation_offload(model, [name], min_tensor_bytes=0)
    lm_loss(model, tokens(1)).backward()
    stats = handle.offloader.stats
    assert stats.offloaded_bytes == expected
    assert stats.offloaded_bytes_by_name == {name: expected}


def test_moe_act_with_activation_recompute_moves_only_the_fc1_output(aten_gemms):
    model = transformer()
    apply_selective_recompute(model, ["moe_act"])
    handle = apply_activation_offload(model, ["moe_act"], min_tensor_bytes=0)
    lm_loss(model, tokens(1)).backward()
    assert handle.offloader.stats.offloaded_bytes == TOKENS * TOP_K * 2 * FFN * FP32


def test_min_tensor_bytes_keeps_small_storages():
    model = transformer()
    handle = apply_activation_offload(model, ["qkv_linear", "expert_fc1"], min_tensor_bytes=TOKENS * HIDDEN * FP32 + 1)
    lm_loss(model, tokens(1)).backward()
    assert handle.offloader.stats.offloaded_bytes == 0
    model = transformer()
    handle = apply_activation_offload(model, ["qkv_linear", "expert_fc1"], min_tensor_bytes=TOKENS * HIDDEN * FP32)
    lm_loss(model, tokens(1)).backward()
    assert handle.offloader.stats.offloaded_bytes == 2 * TOKENS * HIDDEN * FP32


def test_moe_layer_stack_equals_the_plain_run_and_moves_exact_bytes(aten_gemms):
    torch.manual_seed(4)
    config = MoEConfig(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=EXPERTS, top_k=TOP_K, init_std=0.2)
    base = nn.Sequential(MoELayer(config), MoELayer(config), MoELayer(config))
    for layer in base:
        layer.experts.recompute_activation = False
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randn(BATCH, SEQ, HIDDEN, generator=gen) for _ in range(2)]

    def loss_fn(model, hidden):
        return (model(hidden) ** 2).mean()

    want = run(copy.deepcopy(base), batches, loss_fn)
    model = copy.deepcopy(base)
    handle = apply_activation_offload(model, ["expert_fc1", "moe_act"], min_tensor_bytes=0)
    assert handle.modules == {"expert_fc1": ["0.experts", "1.experts", "2.experts"],
                              "moe_act": ["0.experts", "1.experts", "2.experts"]}
    assert_same(run(model, batches, loss_fn, handle.offloader), want)
    per_layer = {"expert_fc1": TOKENS * HIDDEN * FP32, "moe_act": TOKENS * TOP_K * 3 * FFN * FP32}
    # Two steps, layers 0 and 1 offloaded, layer 2 kept.
    assert handle.offloader.stats.offloaded_bytes_by_name == {k: 2 * 2 * v for k, v in per_layer.items()}


def test_reloads_run_one_group_ahead_in_backward_order():
    model = transformer(num_layers=3)
    handle = apply_activation_offload(model, ["expert_fc1"], min_tensor_bytes=0)
    offloader = handle.offloader
    events = []
    reload, unpack = offloader._reload, offloader._unpack

    def logged_reload(group):
        events.append(("reload", group.key))
        reload(group)

    def logged_unpack(h):
        if not events or events[-1] != ("unpack", h.group.key):
            events.append(("unpack", h.group.key))
        return unpack(h)

    offloader._reload, offloader._unpack = logged_reload, logged_unpack  # boundaries read them per forward
    lm_loss(model, tokens(1)).backward()
    keys = [f"layers.{i}.ffn.experts" for i in range(3)]
    assert events == [
        ("unpack", keys[2]), ("reload", keys[1]),  # the kept last layer triggers layer 1's reload
        ("unpack", keys[1]), ("reload", keys[0]),
        ("unpack", keys[0]),
    ]
    assert offloader.stats.reloads_on_demand == 0


def test_micro_batches_are_detected_without_explicit_starts():
    base = transformer()
    batches = [tokens(1), tokens(2)]

    def accumulate(model):
        model.zero_grad(set_to_none=True)
        for batch in batches:  # gradient accumulation: forward, backward, forward, backward
            lm_loss(model, batch).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want = accumulate(copy.deepcopy(base))
    model = copy.deepcopy(base)
    handle = apply_activation_offload(model, ["moe_act", "core_attn"], min_tensor_bytes=0)
    got = accumulate(model)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, **GRAD_TOL, msg=name)
    assert handle.offloader.stats.offloaded_groups == 2 * 2
    assert handle.offloader.stats.reloads_on_demand == 0


def test_expert_gradient_accumulation_under_saved_tensor_hooks():
    """The gradient workspace must see the parameter's accumulated .grad even when saved-tensor
    hooks hand backward other tensor objects (offload, non-reentrant checkpoint)."""
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=EXPERTS, top_k=TOP_K))
    inputs = [torch.randn(8, HIDDEN), torch.randn(8, HIDDEN)]

    def accumulated(hooked: bool) -> torch.Tensor:
        layer.zero_grad(set_to_none=True)
        for x in inputs:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if hooked else nullcontext():
                out = layer(x)
            out.square().sum().backward()
        return layer.experts.fc1_weight.grad.clone()

    torch.testing.assert_close(accumulated(True), accumulated(False), **GRAD_TOL)


def test_forward_without_grad_offloads_nothing():
    model = transformer()
    handle = apply_activation_offload(model, ALL, min_tensor_bytes=0)
    with torch.no_grad():
        model(tokens(1)[:, :-1])
    assert handle.offloader.stats.offloaded_bytes == 0


def test_remove_undoes_everything():
    model = transformer()
    handle = apply_activation_offload(model, ALL)
    assert handle.modules["qkv_linear"] == ["layers.0.attn.qkv_linear", "layers.1.attn.qkv_linear"]
    handle.remove()
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks
        assert not hasattr(module, "_lightning_moe_offload")
        if isinstance(module, GroupedExperts):
            assert module.saved_tensor_tagger is None


def test_errors():
    model = transformer()
    with pytest.raises(ValueError, match=r"Unknown offload module\(s\) \['fc2'\]; choose from"):
        apply_activation_offload(model, ["fc2"])
    with pytest.raises(ValueError, match="min_tensor_bytes must be >= 0"):
        ActivationOffloader("cpu", min_tensor_bytes=-1)
    apply_activation_offload(model, ["attn_norm"])
    with pytest.raises(ValueError, match="already has an activation offload boundary"):
        apply_activation_offload(model, ["attn_norm"])
    with pytest.raises(ValueError, match="Unknown offload module"):
        ActivationOffload(modules=["everything"])


# ---------------------------------------------------------------------------------- the callback


class _LitTransformer(L.LightningModule):
    def __init__(self, model: MoETransformer) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return lm_loss(self.model, batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(model: MoETransformer, callbacks: list) -> tuple[MoETransformer, list[str]]:
    data = torch.utils.data.TensorDataset(torch.stack([tokens(i)[0] for i in range(6)]))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    lit = _LitTransformer(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=2))
    return lit.model, [str(w.message) for w in caught]


def test_callback_trains_like_the_plain_run_and_warns_once_on_cpu():
    base = transformer()
    want, _ = _fit(copy.deepcopy(base), [])
    callback = ActivationOffload(modules=["expert_fc1", "moe_act", "core_attn"], min_tensor_bytes=0)
    got, messages = _fit(copy.deepcopy(base), [callback])
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(p, q, **GRAD_TOL, msg=name)
    assert sum("saves no memory" in m for m in messages) == 1, messages
    assert callback.stats is None  # teardown removed the boundaries
    for module in got.modules():
        assert not hasattr(module, "_lightning_moe_offload")


# ------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_offload_returns_the_same_gradients():
    base = transformer(device="cuda")
    batches = [tokens(1, "cuda"), tokens(2, "cuda")]
    want = run(copy.deepcopy(base), batches)
    model = copy.deepcopy(base)
    apply_selective_recompute(model, ["layernorm"])
    handle = apply_activation_offload(model, ALL, min_tensor_bytes=0)
    got = run(model, batches, offloader=handle.offloader)
    assert_same(got, want)
    d2h, h2d = handle.offloader.streams
    assert d2h is not None and h2d is not None
    assert d2h != torch.cuda.current_stream() and h2d != torch.cuda.current_stream()
    assert handle.offloader.stats.offloaded_bytes > 0
    assert handle.offloader.stats.reloads_on_demand == 0


@pytest.mark.gpu
def test_gpu_offload_copies_overlap_with_later_compute():
    offloader = ActivationOffloader("cuda", min_tensor_bytes=0)
    x = torch.randn(128 * 2**20, device="cuda", requires_grad=True)  # 512 MiB: a copy of several ms

    def layer(index):
        with offloader.boundary(f"layers.{index}", "block"):
            return (x * 1.0).sin()  # sin saves its 512 MiB input

    a = torch.randn(512, 512, device="cuda") / 32
    torch.tanh(a @ a)  # load cuBLAS and the kernels now: host-side set-up must not delay the compute below
    y0 = layer(0)
    torch.cuda.synchronize()
    y1 = layer(1)  # the next group of the same name: layer 0's copy starts on the side stream
    for _ in range(4):  # short compute queued after the copy on the compute stream
        a = torch.tanh(a @ a)
    group0 = offloader._microbatch.order[0]()
    assert group0.state == "offloaded"
    assert all(entry.host.is_pinned() for entry in group0.entries)
    compute_done = torch.cuda.Event()
    compute_done.record()
    compute_finished_first = False
    while not group0.event.query():
        if compute_done.query():
            compute_finished_first = True
    assert compute_finished_first, "the compute queued after the copy waited for it: no overlap"
    (y0.sum() + y1.sum()).backward()
    torch.testing.assert_close(x.grad, 2 * torch.cos(x.detach()), rtol=1e-5, atol=1e-5)
    assert offloader.stats.reloaded_bytes == offloader.stats.offloaded_bytes == x.numel() * 4


@pytest.mark.gpu
def test_gpu_recompute_returns_the_same_gradients():
    base = transformer(device="cuda")  # experts use the grouped_mm kernel on CUDA
    batches = [tokens(1, "cuda"), tokens(2, "cuda")]
    want = run(copy.deepcopy(base), batches)
    model = copy.deepcopy(base)
    apply_selective_recompute(model, ["moe_act", "layernorm", "router", "shared_experts", "attention"])
    assert_same(run(model, batches), want)
