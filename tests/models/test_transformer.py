"""Tests of the reference model `MoETransformer` and its config, on tiny shapes on the CPU.

Oracles: the analytic parameter count against the built module; a meta-device build materialised
with ``reset_parameters`` against a direct build; grouped-query attention against multi-head
attention with repeated kv weights; the sum of head-sharded attention modules (what a tensor-
parallel plan computes per rank) against the unsharded module.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest
import torch

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.models import (
    Attention,
    DenseMLP,
    MoETransformer,
    MoETransformerConfig,
    apply_rotary,
    rotary_cos_sin,
)
from lightning_moe.models import config as config_module

VOCAB, HIDDEN, HEADS, KV_HEADS, EXPERTS = 256, 64, 4, 2, 4
BATCH, SEQ = 2, 12
# fp32 outputs computed by kernels whose blocking may depend on other tokens (the expert GEMMs
# group tokens by their routed expert): a few ulps (docs/architecture.md §9).
FP32_TOL = 1e-5


def tiny_config(**overrides) -> MoETransformerConfig:
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=2,
        num_attention_heads=HEADS,
        num_kv_heads=KV_HEADS,
        ffn_hidden_size=128,
        max_seq_len=32,
        qk_norm=True,
        moe=MoEConfig(hidden_size=HIDDEN, ffn_hidden_size=32, num_experts=EXPERTS, top_k=2),
    )
    fields.update(overrides)
    return MoETransformerConfig(**fields)


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors counted once


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------ forward


def test_forward_backward_reaches_every_parameter():
    model = MoETransformer(tiny_config(first_dense_layers=1))
    batch = tokens()
    logits = model(batch)
    assert logits.shape == (BATCH, SEQ, VOCAB) and logits.dtype == torch.float32
    loss = model.loss(batch[:, :-1], batch[:, 1:])
    assert torch.isfinite(loss)
    assert abs(loss.item() - torch.log(torch.tensor(float(VOCAB))).item()) < 0.5  # near-uniform at init
    loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient reached {missing}"


def test_loss_ignores_ignore_index():
    model = MoETransformer(tiny_config())
    batch = tokens()
    targets = batch.clone()
    targets[:, SEQ // 2 :] = -100
    kept = slice(0, SEQ // 2)
    logits = model(batch)
    expected = torch.nn.functional.cross_entropy(logits[:, kept].flatten(0, 1), batch[:, kept].flatten())
    torch.testing.assert_close(model.loss(batch, targets), expected, rtol=FP32_TOL, atol=FP32_TOL)


def test_causal_later_tokens_do_not_change_earlier_logits():
    model = MoETransformer(tiny_config(first_dense_layers=1)).eval()
    batch = tokens()
    changed = batch.clone()
    position = 7
    changed[:, position] = (changed[:, position] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(batch), model(changed)
    torch.testing.assert_close(after[:, :position], before[:, :position], rtol=FP32_TOL, atol=FP32_TOL)
    assert not torch.allclose(after[:, position:], before[:, position:], atol=1e-3)


def test_padding_mask_reaches_the_moe_layers():
    config = tiny_config(moe=MoEConfig(hidden_size=HIDDEN, ffn_hidden_size=32, num_experts=EXPERTS,
                                       top_k=2, score_func="sigmoid", expert_bias=True))
    model = MoETransformer(config)
    padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    padding[:, -3:] = True
    model(tokens(), padding_mask=padding).sum().backward()
    for layer in model.layers:
        counted = layer.ffn.router.local_tokens_per_expert.sum().item()
        assert counted == (BATCH * SEQ - padding.sum().item()) * 2  # top_k assignments per valid token


def test_forward_rejects_bad_inputs():
    model = MoETransformer(tiny_config())
    with pytest.raises(ValueError, match="exceeds max_seq_len=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match=r"tokens must be an integer tensor \[B, S\]"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"padding_mask must have the shape of tokens \(2, 12\)"):
        model(tokens(), padding_mask=torch.zeros(2, 11, dtype=torch.bool))


# ------------------------------------------------------------------------------------ attention


def test_rotary_is_identity_at_position_zero_and_preserves_norm():
    cos, sin = rotary_cos_sin(5, 8, 10000.0)
    x = torch.randn(2, 5, 3, 8)
    rotated = apply_rotary(x, cos, sin)
    torch.testing.assert_close(rotated[:, 0], x[:, 0])
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))


def test_grouped_query_attention_equals_mha_with_repeated_kv():
    head_dim, group = HIDDEN // HEADS, HEADS // KV_HEADS
    gqa = Attention(HIDDEN, HEADS, KV_HEADS, head_dim, qk_norm=True)
    mha = Attention(HIDDEN, HEADS, HEADS, head_dim, qk_norm=True)
    with torch.no_grad():
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.o_proj.weight.copy_(gqa.o_proj.weight)
        for name in ("k_proj", "v_proj"):  # kv head j serves query heads j*group .. (j+1)*group-1
            weight = getattr(gqa, name).weight.view(KV_HEADS, head_dim, HIDDEN)
            getattr(mha, name).weight.copy_(weight.repeat_interleave(group, dim=0).reshape(-1, HIDDEN))
    x = torch.randn(BATCH, SEQ, HIDDEN)
    cos, sin = rotary_cos_sin(SEQ, head_dim, 10000.0)
    torch.testing.assert_close(gqa(x, cos, sin), mha(x, cos, sin), rtol=FP32_TOL, atol=FP32_TOL)


def _head_shard(full: Attention, rank: int, size: int) -> Attention:
    """This rank's share under a column/row tensor-parallel plan: a copy with sliced projections."""
    shard = Attention(HIDDEN, HEADS, KV_HEADS, full.head_dim, qk_norm=True)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            rows = getattr(full, name).weight.chunk(size, dim=0)[rank]
            linear = torch.nn.Linear(HIDDEN, rows.shape[0], bias=False)
            linear.weight.copy_(rows)
            setattr(shard, name, linear)
        columns = full.o_proj.weight.chunk(size, dim=1)[rank]
        shard.o_proj = torch.nn.Linear(columns.shape[1], HIDDEN, bias=False)
        shard.o_proj.weight.copy_(columns)
        shard.q_norm.load_state_dict(full.q_norm.state_dict())
        shard.k_norm.load_state_dict(full.k_norm.state_dict())
    return shard


def test_attention_reads_local_heads_from_projection_shapes():
    # What a tensor-parallel plan relies on: column-sharded q/k/v and row-sharded o_proj work
    # unchanged, and the partial outputs sum to the full output.
    full = Attention(HIDDEN, HEADS, KV_HEADS, HIDDEN // HEADS, qk_norm=True)
    with torch.no_grad():
        full.q_norm.weight.uniform_(0.5, 1.5)
        full.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    cos, sin = rotary_cos_sin(SEQ, full.head_dim, 10000.0)
    partial = sum(_head_shard(full, rank, 2)(x, cos, sin) for rank in range(2))
    torch.testing.assert_close(partial, full(x, cos, sin), rtol=FP32_TOL, atol=FP32_TOL)


# ------------------------------------------------------------------------------------ initialisation


def test_meta_build_then_reset_equals_direct_build():
    config = tiny_config(first_dense_layers=1, tie_embeddings=True)
    torch.manual_seed(123)
    direct = MoETransformer(config)
    rng_after_direct = torch.get_rng_state()
    torch.manual_seed(123)
    with torch.device("meta"):
        lazy = MoETransformer(config)
    assert torch.equal(torch.get_rng_state(), rng_after_direct)  # one draw either way
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    assert lazy.lm_head.weight is lazy.embed.weight  # still tied after to_empty
    expected, actual = direct.state_dict(), lazy.state_dict()
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key


def test_reset_parameters_redraws_the_same_weights():
    model = MoETransformer(tiny_config())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.reset_parameters()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    std = model.layers[0].attn.q_proj.weight.std().item()
    assert 0.015 < std < 0.025  # normal(0, init_std=0.02)
    assert torch.equal(model.norm.weight, torch.ones(HIDDEN))


def test_weights_depend_on_module_name_not_on_build_order():
    # A deeper model after the same seed shares the first layers' weights exactly (so a pipeline
    # stage that builds only its layers gets the same numbers).
    torch.manual_seed(5)
    short = MoETransformer(tiny_config(num_layers=2))
    torch.manual_seed(5)
    deep = MoETransformer(tiny_config(num_layers=3))
    deep_state = deep.state_dict()
    for key, value in short.state_dict().items():
        assert torch.equal(value, deep_state[key]), key
    assert short.layers[0].ffn.init_seed != short.layers[1].ffn.init_seed


def test_reset_parameters_on_meta_raises():
    with torch.device("meta"):
        model = MoETransformer(tiny_config())
    with pytest.raises(RuntimeError, match="to_empty"):
        model.reset_parameters()


def test_tied_embeddings_share_one_tensor():
    config = tiny_config(tie_embeddings=True)
    model = MoETransformer(config)
    assert model.lm_head.weight is model.embed.weight
    assert param_count(model) == config.num_parameters()
    untied = tiny_config(tie_embeddings=False)
    assert untied.num_parameters() - config.num_parameters() == VOCAB * HIDDEN
    model.to(torch.float64)
    assert model.lm_head.weight is model.embed.weight


# ------------------------------------------------------------------------------------ layer pattern


@pytest.mark.parametrize(
    ("num_layers", "freq", "first_dense", "expected_moe"),
    [
        (4, 1, 0, [0, 1, 2, 3]),
        (5, 2, 0, [0, 2, 4]),
        (5, 2, 1, [2, 4]),  # DeepSeek: i >= k and i % N == 0
        (5, 1, 3, [3, 4]),
        (4, [0, 1, 1, 0], 0, [1, 2]),
        (4, [1, 1, 0, 1], 1, [1, 3]),  # a list AND first_dense_layers
    ],
)
def test_moe_and_dense_layers_are_placed_as_configured(num_layers, freq, first_dense, expected_moe):
    config = tiny_config(num_layers=num_layers, moe_layer_freq=freq, first_dense_layers=first_dense)
    assert config.moe_layers == expected_moe
    with torch.device("meta"):
        model = MoETransformer(config)
    for index, layer in enumerate(model.layers):
        expected_type = MoELayer if index in expected_moe else DenseMLP
        assert isinstance(layer.ffn, expected_type), index
        assert config.is_moe_layer(index) == (index in expected_moe)
    assert param_count(model) == config.num_parameters()


def test_dense_model_without_moe():
    config = tiny_config(moe=None)
    model = MoETransformer(config)
    assert all(isinstance(layer.ffn, DenseMLP) for layer in model.layers)
    assert param_count(model) == config.num_parameters() == config.num_parameters(active=True)
    model(tokens()).sum().backward()


# ------------------------------------------------------------------------------------ parameter count


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_kv_heads": None, "qk_norm": False, "head_dim": 32},
        {"tie_embeddings": True, "first_dense_layers": 1},
        {
            "moe": MoEConfig(
                hidden_size=HIDDEN, ffn_hidden_size=24, num_experts=8, top_k=3, activation="gelu",
                fc2_bias=True, shared_expert_ffn_hidden_size=40, shared_expert_gate=True,
                score_func="sigmoid", expert_bias=True,
            ),
        },
        {"attention_bias": True, "partial_rotary_factor": 0.5},
        {"attention_bias": True, "num_kv_heads": None, "qk_norm": "full"},
        {
            "moe": MoEConfig(
                hidden_size=HIDDEN, ffn_hidden_size=24, num_experts=8, top_k=2, activation="clamped_swiglu",
                fc1_bias=True, fc2_bias=True, router_bias=True,
            ),
        },
        {
            "moe": MoEConfig(hidden_size=HIDDEN, ffn_hidden_size=24, num_experts=8, top_k=2, activation="relu",
                             fc1_bias=True),
        },
    ],
    ids=["default", "mha-head-dim", "tied-first-dense", "gelu-bias-shared", "qkv-bias-partial-rotary",
         "qkv-bias-full-norm", "gpt-oss-experts", "relu-fc1-bias"],
)
def test_num_parameters_matches_the_module(overrides):
    config = tiny_config(**overrides)
    with torch.device("meta"):
        model = MoETransformer(config)
    assert param_count(model) == config.num_parameters()


def test_active_parameters_count_top_k_experts():
    moe = MoEConfig(hidden_size=HIDDEN, ffn_hidden_size=32, num_experts=EXPERTS, top_k=2,
                    shared_expert_ffn_hidden_size=16)
    config = tiny_config(moe=moe, num_layers=3, first_dense_layers=1)
    per_expert = 3 * HIDDEN * 32  # gate, up and down rows of one SwiGLU expert
    inactive = (EXPERTS - 2) * per_expert * 2  # two MoE layers
    assert config.num_parameters() - config.num_parameters(active=True) == inactive


# ------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"vocab_size": 0}, r"vocab_size must be >= 1, got 0"),
        ({"norm_eps": 0.0}, r"norm_eps must be > 0, got 0.0"),
        ({"num_kv_heads": 3}, r"num_kv_heads=3 must be >= 1 and divide num_attention_heads=4"),
        (
            {"num_attention_heads": 6, "num_kv_heads": None},
            r"hidden_size=64 is not divisible by num_attention_heads=6; set head_dim",
        ),
        ({"head_dim": 15}, r"head_dim=15 must be even"),
        ({"partial_rotary_factor": 0.0}, r"partial_rotary_factor=0.0 must be in \(0, 1\]"),
        ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor=1.5 must be in \(0, 1\]"),
        ({"partial_rotary_factor": 0.3125}, r"rotates int\(16 \* 0.3125\) = 5 features, which must be even"),
        ({"attention": "mla", "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
          "num_kv_heads": None, "qk_norm": False, "attention_bias": True},
         r"attention_bias=True and partial_rotary_factor=1.0 apply to attention='mha' only"),
        ({"moe_layer_freq": 0}, r"moe_layer_freq=0 must be >= 1"),
        ({"moe_layer_freq": [1, 0, 1]}, r"needs num_layers=2 entries of 0 or 1 .* got 3 entries"),
        ({"moe_layer_freq": [1, 2]}, r"needs num_layers=2 entries of 0 or 1"),
        ({"first_dense_layers": 3}, r"first_dense_layers=3 must be between 0 and num_layers=2"),
        ({"first_dense_layers": 2}, r"moe is set but no layer is MoE .* set moe: null"),
        (
            {"first_dense_layers": 1, "ffn_hidden_size": None},
            r"layers \[0\] are dense but ffn_hidden_size=None",
        ),
        ({"moe": MoEConfig(hidden_size=32, ffn_hidden_size=32, num_experts=4)},
         r"moe.hidden_size=32 differs from hidden_size=64.* Set moe.hidden_size: 64"),
    ],
)
def test_bad_configs_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides)


def test_attention_biases_start_at_zero_and_partial_rotary_leaves_the_rest_of_each_head():
    config = tiny_config(attention_bias=True, partial_rotary_factor=0.5)
    model = MoETransformer(config)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(model.layers[0].attn, name).bias, torch.zeros_like(getattr(model.layers[0].attn, name).bias))
    assert model.layers[0].attn.o_proj.bias is None
    # Oracle: position 0 rotates by angle 0, so with a rotation of the first half only, a head's
    # second half must come out of apply_rotary unchanged at every position.
    from lightning_moe.models import apply_rotary, rotary_cos_sin

    x = torch.randn(1, 5, 2, 16)
    cos, sin = rotary_cos_sin(5, config.rotary_dim, config.rope_theta)
    rotated = apply_rotary(x, cos, sin)
    assert config.rotary_dim == 8 and torch.equal(rotated[..., 8:], x[..., 8:])
    assert torch.allclose(rotated[:, 0], x[:, 0]) and not torch.allclose(rotated[:, 1:, :, :8], x[:, 1:, :, :8])


def test_is_moe_layer_rejects_out_of_range():
    with pytest.raises(IndexError, match="layer index 2 is out of range for num_layers=2"):
        tiny_config().is_moe_layer(2)


def test_config_is_a_plain_dataclass():
    config = tiny_config(moe_layer_freq=(1, 0))
    assert config.moe_layer_freq == [1, 0]  # normalised to a list (YAML and CLI give lists)
    assert dataclasses.replace(config, num_layers=2) == config


def test_every_config_field_has_a_docstring():
    # Attribute docstrings are the CLI --help text (jsonargparse reads them from the source).
    tree = ast.parse(inspect.getsource(config_module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MoETransformerConfig")
    documented = {
        stmt.target.id
        for stmt, following in zip(cls.body, cls.body[1:])
        if isinstance(stmt, ast.AnnAssign)
        and isinstance(following, ast.Expr)
        and isinstance(following.value, ast.Constant)
        and isinstance(following.value.value, str)
    }
    assert documented == {f.name for f in dataclasses.fields(MoETransformerConfig)}
