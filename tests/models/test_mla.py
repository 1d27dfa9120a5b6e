"""Multi-head latent attention (DeepSeek-V2/V3 MLA) of the reference model.

Oracles: ``transformers``' own ``DeepseekV3Attention`` (outputs and every gradient, fp32), with
its weights copied in by an explicit name table written here; the single-device model for the
tensor-parallel run (TP=2 on two gloo ranks against TP=1: loss, logits and every gradient after
:class:`GradSync`); the meta-device build for the analytic parameter count.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from helpers.asserts import assert_close_to_scale
from helpers.dist import run_distributed
from torch.distributed.tensor import DTensor

from lightning_moe import MoEConfig
from lightning_moe.models import (
    MoETransformer,
    MoETransformerConfig,
    MultiLatentAttention,
    RopeScaling,
    rotary_cos_sin,
)

# fp32 attention computed by differently blocked kernels (SDPA vs HF's, sharded heads): a few ulps.
FP32_TOL = 1e-5
HIDDEN, HEADS, BATCH, SEQ = 32, 4, 2, 12
NOPE, ROPE, V_DIM, KV_RANK, Q_RANK = 8, 8, 12, 16, 24

# Our MLA parameter -> DeepseekV3Attention parameter (the two checkpoints' names).
HF_NAMES = {
    "q_proj.weight": "q_proj.weight",
    "q_down_proj.weight": "q_a_proj.weight",
    "q_latent_norm.weight": "q_a_layernorm.weight",
    "q_up_proj.weight": "q_b_proj.weight",
    "kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_latent_norm.weight": "kv_a_layernorm.weight",
    "kv_up_proj.weight": "kv_b_proj.weight",
    "o_proj.weight": "o_proj.weight",
}

# (q_lora_rank, rope_interleave, HF rope_parameters): the low-rank and the full query projection,
# both rotary layouts, and YaRN with an mscale that changes the cos/sin tables (mscale !=
# mscale_all_dim) as well as the softmax scale (mscale_all_dim).
VARIANTS = {
    "q-lora-interleaved-yarn": (
        Q_RANK, True,
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
    ),
    "q-proj-half-rotary": (None, False, {"rope_type": "default", "rope_theta": 500.0}),
}


def _hf_attention(q_lora_rank, interleave, rope_parameters):
    transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank, kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=V_DIM, rope_interleave=interleave, rope_parameters=dict(rope_parameters),
        max_position_embeddings=128, num_hidden_layers=1,
    )
    config._attn_implementation = "sdpa"  # causal without an explicit mask, as ours
    torch.manual_seed(0)
    attention = hf.DeepseekV3Attention(config, layer_idx=0)
    with torch.no_grad():
        for param in attention.parameters():
            param.normal_(0.0, 0.2) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    return attention, hf.DeepseekV3RotaryEmbedding(config)


def _ours_like(hf_attention, q_lora_rank, interleave, rope_parameters):
    scaling = None
    if rope_parameters["rope_type"] == "yarn":
        scaling = RopeScaling(
            factor=rope_parameters["factor"],
            original_max_seq_len=rope_parameters["original_max_position_embeddings"],
            mscale=rope_parameters["mscale"], mscale_all_dim=rope_parameters["mscale_all_dim"],
        )
    ours = MultiLatentAttention(
        HIDDEN, HEADS, kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=V_DIM, q_lora_rank=q_lora_rank, rope_interleaved=interleave,
        softmax_scale=MultiLatentAttention.default_softmax_scale(NOPE + ROPE, scaling),
    )
    theirs = dict(hf_attention.named_parameters())
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.copy_(theirs[HF_NAMES[name]])
    assert len(list(ours.parameters())) == len(theirs)
    cos, sin = rotary_cos_sin(SEQ, ROPE, rope_parameters["rope_theta"], scaling=scaling)
    return ours, cos, sin


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_mla_equals_transformers_deepseek_v3_attention(variant):
    q_lora_rank, interleave, rope_parameters = VARIANTS[variant]
    hf_attention, rotary = _hf_attention(q_lora_rank, interleave, rope_parameters)
    ours, cos, sin = _ours_like(hf_attention, q_lora_rank, interleave, rope_parameters)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))
    x_ours, x_hf = x.clone().requires_grad_(), x.clone().requires_grad_()
    positions = torch.arange(SEQ)[None]
    expected, _ = hf_attention(x_hf, rotary(x_hf, positions), attention_mask=None)
    actual = ours(x_ours, cos, sin)
    assert_close_to_scale(actual, expected, FP32_TOL, "output")
    upstream = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
    (expected * upstream).sum().backward()
    (actual * upstream).sum().backward()
    assert_close_to_scale(x_ours.grad, x_hf.grad, FP32_TOL, "input gradient")
    theirs = dict(hf_attention.named_parameters())
    for name, param in ours.named_parameters():
        assert_close_to_scale(param.grad, theirs[HF_NAMES[name]].grad, FP32_TOL, f"gradient of {name}")


def test_yarn_softmax_scale_is_deepseeks_mscale_squared():
    scaling = RopeScaling(factor=40.0, original_max_seq_len=4096, mscale=1.0, mscale_all_dim=1.0)
    mscale = 0.1 * math.log(40.0) + 1.0
    assert MultiLatentAttention.default_softmax_scale(192, scaling) == pytest.approx(192**-0.5 * mscale**2)
    assert MultiLatentAttention.default_softmax_scale(192, None) == pytest.approx(192**-0.5)


# ------------------------------------------------------------------------------------ model config


def mla_config(**overrides) -> MoETransformerConfig:
    fields = dict(
        vocab_size=64, hidden_size=HIDDEN, num_layers=2, num_attention_heads=HEADS, ffn_hidden_size=48,
        max_seq_len=32, attention="mla", q_lora_rank=Q_RANK, kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=V_DIM, rope_interleaved=True, first_dense_layers=1,
        rope_scaling=RopeScaling(factor=4.0, original_max_seq_len=8, mscale=1.0, mscale_all_dim=1.0),
        moe=MoEConfig(HIDDEN, 16, 8, top_k=2, score_func="sigmoid", expert_bias=True, num_groups=4,
                      group_top_k=2, topk_scaling_factor=2.5, shared_expert_ffn_hidden_size=16),
    )
    fields.update(overrides)
    return MoETransformerConfig(**fields)


@pytest.mark.parametrize("q_lora_rank", [Q_RANK, None], ids=["q-lora", "q-proj"])
def test_mla_parameter_count_is_exact(q_lora_rank):
    config = mla_config(q_lora_rank=q_lora_rank)
    with torch.device("meta"):
        model = MoETransformer(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()
    attention = model.layers[0].attn
    assert isinstance(attention, MultiLatentAttention)
    assert attention.kv_down_proj.weight.shape == (KV_RANK + ROPE, HIDDEN)
    assert attention.kv_up_proj.weight.shape == (HEADS * (NOPE + V_DIM), KV_RANK)
    assert attention.o_proj.weight.shape == (HIDDEN, HEADS * V_DIM)


def test_mla_model_meta_build_then_reset_equals_direct_build_and_trains():
    config = mla_config()
    torch.manual_seed(5)
    direct = MoETransformer(config)
    torch.manual_seed(5)
    with torch.device("meta"):
        lazy = MoETransformer(config)
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    for key, value in direct.state_dict().items():
        assert torch.equal(value, lazy.state_dict()[key]), key
    batch = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    direct.loss(batch[:, :-1], batch[:, 1:]).backward()
    missing = [n for n, p in direct.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient reached {missing}"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kv_lora_rank": None}, "attention='mla' needs kv_lora_rank"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 must be even"),
        ({"num_kv_heads": 2}, "num_kv_heads=2 does not apply to attention='mla'"),
        ({"qk_norm": True}, "qk_norm does not apply to attention='mla'"),
        ({"attention": "mqa"}, "Unknown attention 'mqa'"),
    ],
)
def test_mla_config_errors_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        mla_config(**overrides)


def test_mha_config_refuses_mla_fields():
    with pytest.raises(ValueError, match="kv_lora_rank=16 only applies to attention='mla'"):
        MoETransformerConfig(vocab_size=64, hidden_size=HIDDEN, num_layers=1, num_attention_heads=HEADS,
                             ffn_hidden_size=48, kv_lora_rank=16)


# ------------------------------------------------------------------------------------ bf16


# bf16 autocast against the fp32 model: the loss and every gradient within bf16's few-digit
# rounding, relative to each tensor's scale.
BF16_LOSS_TOL, BF16_GRAD_TOL = 5e-3, 5e-2


def _bf16_matches_fp32(device: str) -> None:
    torch.manual_seed(5)
    reference = MoETransformer(mla_config())
    model = copy.deepcopy(reference).to(device)
    batch = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    on_device = batch.to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model.loss(on_device[:, :-1], on_device[:, 1:])
    loss.backward()
    ref_loss = reference.loss(batch[:, :-1], batch[:, 1:])
    ref_loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert abs(loss.item() - ref_loss.item()) <= BF16_LOSS_TOL * ref_loss.item()
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad.dtype == torch.float32, name  # fp32 master weights keep fp32 gradients
        assert torch.isfinite(param.grad).all(), name
        assert_close_to_scale(param.grad.cpu(), ref_params[name].grad, BF16_GRAD_TOL, f"bf16 gradient of {name}")


def test_mla_model_under_cpu_bf16_autocast_matches_fp32():
    # CPU proxy of the CUDA test below: the same dtype flow (bf16 GEMMs and attention, fp32 norms,
    # rotary and routing) under CPU autocast.
    _bf16_matches_fp32("cpu")


@pytest.mark.gpu
def test_mla_model_under_cuda_bf16_autocast_matches_fp32():
    # On CUDA, SDPA picks a fused kernel for queries/keys of width 16 and values of width 12.
    _bf16_matches_fp32("cuda")


# ------------------------------------------------------------------------------------ tensor parallel


def _tp_configs() -> dict[str, MoETransformerConfig]:
    return {
        "mla": mla_config(moe=None, first_dense_layers=0),
        # OLMoE's q/k norm spans every head, which tensor parallelism splits across the ranks.
        "qk-norm-full": MoETransformerConfig(
            vocab_size=64, hidden_size=HIDDEN, num_layers=2, num_attention_heads=HEADS, num_kv_heads=2,
            ffn_hidden_size=48, qk_norm="full",
        ),
    }


def _tp_matches_single_device(rank: int, world: int, name: str) -> dict:
    from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize
    from lightning_moe.parallel.grad_sync import GradSync

    torch.manual_seed(0)
    reference = MoETransformer(_tp_configs()[name])
    with torch.no_grad():  # norms away from ones, so their gradients and sharding matter
        for param_name, param in reference.named_parameters():
            if "norm" in param_name:
                param.uniform_(0.5, 1.5)
    model = copy.deepcopy(reference)
    ctx = build_parallel_context(ParallelDims(world, tp=2), "cpu")
    parallelize(model, ctx)
    attention = model.layers[0].attn
    def placements_of(param: torch.Tensor) -> str:
        return str(getattr(param, "placements", "plain tensor"))

    if name == "mla":  # replicated down projection, head-sharded up projection
        placements = {"down": placements_of(attention.kv_down_proj.weight),
                      "up": placements_of(attention.kv_up_proj.weight)}
    else:
        placements = {"q_norm": placements_of(attention.q_norm.weight)}
    sync = GradSync(model, ctx)
    batch = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    loss = model.loss(batch[:, :-1], batch[:, 1:])
    loss.backward()
    sync.finish()
    ref_loss = reference.loss(batch[:, :-1], batch[:, 1:])
    ref_loss.backward()
    errors = {"loss": abs(loss.item() - ref_loss.item())}
    with torch.no_grad():
        logits = model.full_logits(model(batch[:, :-1]))  # each TP rank holds a vocabulary slice
        errors["logits"] = (logits - reference(batch[:, :-1])).abs().max().item()
    ref_params = dict(reference.named_parameters())
    for param_name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        errors[f"grad {param_name}"] = (grad - ref_params[param_name].grad).abs().max().item()
    dist.barrier()
    return {"errors": errors, "placements": placements}


EXPECTED_PLACEMENTS = {
    "mla": {"down": "(Replicate(),)", "up": "(Shard(dim=0),)"},
    "qk-norm-full": {"q_norm": "(Replicate(),)"},
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(EXPECTED_PLACEMENTS))
def test_tensor_parallel_two_ranks_equals_one(name, tmp_path):
    results = run_distributed(_tp_matches_single_device, 2, name, timeout_s=180, tmp_dir=tmp_path)
    for rank, result in enumerate(results):
        assert result["placements"] == EXPECTED_PLACEMENTS[name], rank
        failures = {key: err for key, err in result["errors"].items() if not err <= FP32_TOL}
        assert not failures, f"rank {rank}: {failures}"


@pytest.mark.parametrize(("kind", "names"), [("recompute", ["attention"]), ("offload", ["qkv_linear", "core_attn"])])
def test_mla_blocks_are_found_by_recompute_and_offload_and_train_alike(kind, names):
    """``attention`` recompute and ``qkv_linear`` offload reach MLA's modules; outputs and gradients unchanged."""
    from lightning_moe.memory import apply_activation_offload, apply_selective_recompute

    torch.manual_seed(0)
    model = MoETransformer(mla_config())
    tokens = torch.randint(0, model.config.vocab_size, (2, 8))
    model(tokens).float().pow(2).mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    if kind == "recompute":
        handle = apply_selective_recompute(model, names, strict=True)
    else:
        handle = apply_activation_offload(model, names, min_tensor_bytes=0, strict=True)
    matched = handle.modules["attention" if kind == "recompute" else "qkv_linear"]
    assert len(matched) == model.config.num_layers, matched  # one per MLA block (strict=True refuses none)
    model(tokens).float().pow(2).mean().backward()
    for name, grad in want.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-6, atol=1e-7)
