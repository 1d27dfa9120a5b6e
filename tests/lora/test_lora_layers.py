"""LoRA adapters on one device: frozen base, unchanged output at B = 0, and the adapted experts
and linear layers against a per-expert loop with ``W + alpha/r * B @ A`` built by hand."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.asserts import assert_close_to_scale

from lightning_moe import MoEConfig
from lightning_moe.layers.activations import is_gated
from lightning_moe.layers.expert_kernels import reference_expert_mlp
from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.layers.moe import MoELayer
from lightning_moe.lora import (
    LoRAConfig,
    LoRAGroupedExperts,
    LoRALinear,
    adapter_parameters,
    apply_lora,
    lora_modules,
    merge_lora,
)
from lightning_moe.models import MoETransformer, MoETransformerConfig

HIDDEN, FFN = 16, 8  # multiples of 8: grouped_mm's aligned strides
COUNTS = [3, 0, 5, 2]  # expert 1 gets no rows
RANK, ALPHA = 3, 6.0  # a rank that is not a multiple of 8 (padded inside the computation)
SCALE = ALPHA / RANK
# fp32 grouped GEMMs against the fp32 per-expert reference: the same products summed in another order.
FP32_OUT_TOL = 1e-5
FP32_GRAD_TOL = 1e-4


def _experts(activation: str) -> LoRAGroupedExperts:
    experts = GroupedExperts(len(COUNTS), HIDDEN, FFN, activation)
    experts.reset_parameters(layer_seed=3, std=0.5)
    LoRAGroupedExperts.convert(experts, RANK, SCALE, 0.0, seed=11)
    experts.fc1_weight.requires_grad_(False)
    experts.fc2_weight.requires_grad_(False)
    return experts


def _randomise_b(module) -> None:
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


def _reference(experts: LoRAGroupedExperts, rows, probs):
    """Per-expert loop over the merged weights, built from the adapters with autograd."""
    fc1 = torch.stack([experts.fc1_weight[e] + SCALE * experts.fc1_lora_B[e] @ experts.fc1_lora_A[e]
                       for e in range(len(COUNTS))])
    fc2 = torch.stack([experts.fc2_weight[e] + SCALE * experts.fc2_lora_B[e] @ experts.fc2_lora_A[e]
                       for e in range(len(COUNTS))])
    return reference_expert_mlp(rows, fc1, fc2, probs, COUNTS, experts.activation)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_experts_equal_per_expert_merged_reference(activation):
    experts = _experts(activation)
    _randomise_b(experts)
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(sum(COUNTS), HIDDEN, generator=gen, requires_grad=True)
    probs = torch.rand(sum(COUNTS), generator=gen)
    weights = torch.randn(sum(COUNTS), HIDDEN, generator=gen)
    out = experts(rows, COUNTS, probs)
    (out * weights).sum().backward()
    got = {n: p.grad.clone() for n, p in experts.named_parameters() if p.requires_grad}
    got_x = rows.grad.clone()
    for p in experts.parameters():
        p.grad = None
    rows.grad = None
    want = _reference(experts, rows, probs)
    (want * weights).sum().backward()
    assert_close_to_scale(out, want, FP32_OUT_TOL, "output")
    assert_close_to_scale(got_x, rows.grad, FP32_GRAD_TOL, "input grad")
    assert set(got) == {"fc1_lora_A", "fc1_lora_B", "fc2_lora_A", "fc2_lora_B"}
    for name, grad in got.items():
        assert_close_to_scale(grad, getattr(experts, name).grad, FP32_GRAD_TOL, name)
    # The empty expert's adapters get exactly zero gradient.
    assert not got["fc1_lora_A"][1].any() and not got["fc2_lora_B"][1].any()


def test_fused_row_index_matches_permuted_rows():
    experts = _experts("swiglu")
    _randomise_b(experts)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randn(6, HIDDEN, generator=gen)
    row_index = torch.randint(0, 6, (sum(COUNTS),), generator=gen)
    probs = torch.rand(sum(COUNTS), generator=gen)
    fused = experts(tokens, COUNTS, probs, row_index=row_index, num_out_rows=6)
    rows_out = experts(tokens[row_index], torch.tensor(COUNTS), probs)
    want = torch.zeros(6, HIDDEN).index_add_(0, row_index, rows_out)
    assert_close_to_scale(fused, want, FP32_OUT_TOL, "fused permutation")


def _layer(activation="swiglu", shared=8) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(MoEConfig(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=4, top_k=2,
                              activation=activation, shared_expert_ffn_hidden_size=shared))


def test_zero_b_leaves_the_layer_unchanged_and_freezes_the_base():
    layer = _layer()
    plain = copy.deepcopy(layer)
    apply_lora(layer, LoRAConfig(rank=RANK, alpha=ALPHA))
    assert isinstance(layer.experts, LoRAGroupedExperts)
    assert isinstance(layer.shared_expert.fc1, LoRALinear) and isinstance(layer.shared_expert.fc2, LoRALinear)
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(3))
    out = layer(x)
    assert_close_to_scale(out, plain(x), FP32_OUT_TOL, "B = 0")
    out.square().sum().backward()
    trainable = {n for n, p in layer.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in layer.named_parameters() if n.rsplit(".", 1)[-1].endswith(("lora_A", "lora_B"))}
    assert all(p.grad is None for n, p in layer.named_parameters() if n not in trainable)
    # B = 0 at the start: only B gets a gradient from the loss (A's is B^T times something).
    assert all(p.grad is not None for p in adapter_parameters(layer))


def test_linear_adapter_equals_merged_weight():
    torch.manual_seed(0)
    linear = torch.nn.Linear(HIDDEN, 12, bias=True)
    w, b = linear.weight.detach().clone(), linear.bias.detach().clone()
    LoRALinear.convert(linear, RANK, SCALE, 0.0, seed=1)
    _randomise_b(linear)
    x = torch.randn(4, HIDDEN)
    want = torch.nn.functional.linear(x, w + SCALE * linear.lora_B.detach() @ linear.lora_A.detach(), b)
    assert_close_to_scale(linear(x), want, FP32_OUT_TOL, "LoRALinear")


def _tiny_model() -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(MoETransformerConfig(
        vocab_size=64, hidden_size=HIDDEN, num_layers=2, num_attention_heads=2, num_kv_heads=2,
        ffn_hidden_size=16, max_seq_len=16, first_dense_layers=0,
        moe=MoEConfig(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=4, top_k=2),
    ))


def test_targets_by_name_pattern_and_bf16_base():
    model = _tiny_model()
    apply_lora(model, LoRAConfig(rank=2, alpha=2, targets=["layers.1.attn.q_proj", "o_proj"], base_dtype="bfloat16"))
    adapted = sorted(n for n, m in model.named_modules() if isinstance(m, LoRALinear))
    assert adapted == ["layers.0.attn.o_proj", "layers.1.attn.o_proj", "layers.1.attn.q_proj"]
    assert not any(isinstance(m, LoRAGroupedExperts) for m in model.modules())
    assert model.layers[1].attn.q_proj.weight.dtype == torch.bfloat16
    assert model.layers[1].attn.q_proj.lora_A.dtype == torch.float32
    logits = model(torch.randint(0, 64, (2, 8)))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_errors():
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        LoRAConfig(rank=0, alpha=1)
    with pytest.raises(ValueError, match="dropout must be in"):
        LoRAConfig(rank=2, alpha=1, dropout=1.0)
    with pytest.raises(ValueError, match="base_dtype must be one of"):
        LoRAConfig(rank=2, alpha=1, base_dtype="int8")
    with pytest.raises(ValueError, match="targets must be a list"):
        LoRAConfig(rank=2, alpha=1, targets="q_proj")
    with pytest.raises(ValueError, match="matches nothing"):
        apply_lora(_tiny_model(), LoRAConfig(rank=2, alpha=1, targets=["nothing_*"]))
    model = apply_lora(_tiny_model(), LoRAConfig(rank=2, alpha=1))
    with pytest.raises(RuntimeError, match="already has LoRA adapters"):
        apply_lora(model, LoRAConfig(rank=2, alpha=1))
    odd = GroupedExperts(2, 12, 8)
    with pytest.raises(ValueError, match="multiple of 8"):
        LoRAGroupedExperts.convert(odd, 2, 1.0, 0.0, 0)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_gated_adapter_state_dict_layout(activation):
    experts = _experts(activation)
    state = experts.state_dict()
    expected = (len(COUNTS), 2, FFN, RANK) if is_gated(activation) else (len(COUNTS), FFN, RANK)
    assert tuple(state["fc1_lora_B"].shape) == expected
    fresh = _experts(activation)
    _randomise_b(experts)
    fresh.load_state_dict(experts.state_dict())
    assert torch.equal(fresh.fc1_lora_B, experts.fc1_lora_B)


def test_merge_lora_keeps_the_logits_and_restores_the_plain_keys():
    model = _tiny_model()
    plain_keys = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA))
    _randomise_b(model)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        adapted = model(tokens)
    merge_lora(model)
    assert not lora_modules(model)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == plain_keys
    with torch.no_grad():
        merged = model(tokens)
    assert_close_to_scale(merged, adapted, FP32_OUT_TOL, "merged logits")
    # The adapters changed the model (the comparison is not vacuous).
    plain = _tiny_model()
    with torch.no_grad():
        assert (plain(tokens) - adapted).abs().max() > 10 * FP32_OUT_TOL * adapted.abs().max()
