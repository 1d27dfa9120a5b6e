"""GPT-OSS's attention on one device: sinks, sliding windows per layer, the output projection's bias.

Oracle: eager attention written here as ``transformers``' GPT-OSS ``eager_attention_forward``
computes it (scores, the window mask ``i - W < j <= i``, a sink column per head appended, softmax,
the sink column dropped), in float64 with autograd for the gradients, d(sinks) included. The whole
model is compared with a copy whose core attention modules are replaced by that eager attention
(each with its layer's window), so everything else (projections, biases, norms, rotary) is shared
and only the attention kernel path is under test; the parameter count against the built module.
Where ``transformers`` is installed, the core attention is also compared with its own GPT-OSS
``eager_attention_forward`` under its own ``sliding_window_causal_mask_function``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_moe import MoEConfig
from lightning_moe.memory import apply_selective_recompute
from lightning_moe.models import Attention, CoreAttention, MoETransformer, MoETransformerConfig
from lightning_moe.parallel.context_parallel import lse as lse_attention

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SEQ = 32, 4, 2, 8, 12


def eager_attention(q, k, v, sinks, window, scale):
    """GPT-OSS's eager attention over positions ``0..S-1``: softmax over [scores, sink], sink dropped."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    positions = torch.arange(q.shape[2])
    i, j = positions[:, None], positions[None, :]
    visible = j <= i
    if window is not None:
        visible = visible & (j > i - window)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    if sinks is None:
        return scores.softmax(-1) @ v
    column = sinks.reshape(1, -1, 1, 1).to(scores.dtype).expand(q.shape[0], -1, q.shape[2], 1)
    return torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1] @ v


class EagerCoreAttention(nn.Module):
    """The oracle in place of a model's core attention (float64 inside)."""

    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.window = window

    def forward(self, q, k, v, sinks=None):
        out = eager_attention(q.double(), k.double(), v.double(), None if sinks is None else sinks.double(),
                              self.window, q.shape[-1] ** -0.5)
        return out.to(q.dtype)


def _qkv(seed: int = 0, dv: int = HEAD_DIM):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, HEADS, SEQ, HEAD_DIM, generator=g)
    k = torch.randn(2, KV_HEADS, SEQ, HEAD_DIM, generator=g)
    v = torch.randn(2, KV_HEADS, SEQ, dv, generator=g)
    sinks = torch.randn(HEADS, generator=g)
    grad = torch.randn(2, HEADS, SEQ, dv, generator=g)
    return q, k, v, sinks, grad


@pytest.mark.parametrize("tile", [lse_attention.WINDOW_TILE, 4], ids=["one-tile", "tiles-of-4"])
@pytest.mark.parametrize("window", [None, 1, 3, 5, SEQ - 1, SEQ + 5])
@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "no-sinks"])
def test_core_attention_equals_eager_forward_and_gradients(window, with_sinks, tile, monkeypatch):
    # Tiles of 4 query rows (or the window, if longer) over the keys in their windows: several calls.
    monkeypatch.setattr(lse_attention, "WINDOW_TILE", tile)
    q, k, v, sinks, grad = _qkv(dv=6)  # a value width other than the key's
    inputs = [q, k, v] + ([sinks] if with_sinks else [])
    inputs = [t.clone().requires_grad_() for t in inputs]
    out = CoreAttention(sliding_window=window)(*inputs)
    got = torch.autograd.grad(out, inputs, grad)
    wide = [t.detach().double().requires_grad_() for t in inputs]
    want_out = eager_attention(*wide[:3], wide[3] if with_sinks else None, window, HEAD_DIM**-0.5)
    want = torch.autograd.grad(want_out, wide, grad.double())
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    for name, g, w in zip(("q", "k", "v", "sinks"), got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"d{n}: {m}")


def test_a_window_on_one_device_computes_only_the_keys_its_tiles_reach(monkeypatch):
    monkeypatch.setattr(lse_attention, "WINDOW_TILE", 4)
    shapes = []
    kernel = lse_attention.select_block_kernel(*_qkv()[:3:2])
    original = kernel.forward

    def recording(q, k, v, causal, scale, mask=None):
        shapes.append((q.shape[2], k.shape[2]))
        return original(q, k, v, causal, scale, mask)

    monkeypatch.setattr(kernel, "forward", recording)
    q, k, v, sinks, _ = _qkv()
    CoreAttention(sliding_window=3)(q, k, v, sinks)
    # Rows 0-3 over keys 0-3, rows 4-7 over keys 2-7, rows 8-11 over keys 6-11 (a window of 3 reaches 2 back).
    assert shapes == [(4, 4), (4, 6), (4, 6)]


def test_sinks_and_window_change_the_result():
    # Guards the comparisons against a sink or window the eager oracle would ignore too.
    q, k, v, sinks, _ = _qkv()
    plain = eager_attention(q, k, v, None, None, 0.3)
    assert not torch.allclose(eager_attention(q, k, v, sinks, None, 0.3), plain)
    assert not torch.allclose(eager_attention(q, k, v, None, 3, 0.3), plain)


def _config(**overrides) -> MoETransformerConfig:
    fields = dict(
        vocab_size=64, hidden_size=HIDDEN, num_layers=4, num_attention_heads=HEADS, num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, ffn_hidden_size=48, first_dense_layers=1, max_seq_len=32, init_std=0.2,
        attention_out_bias=True, attention_sinks=True, sliding_window=3,
        layer_types=["sliding_attention", "full_attention"] * 2,
        moe=MoEConfig(HIDDEN, 16, 4, top_k=2),
    )
    fields.update(overrides)
    return MoETransformerConfig(**fields)


def _randomise_biases_and_sinks(model: MoETransformer) -> None:
    # They start at zeros (biases) or small values: make them matter.
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.bias", "attn.sinks")):
                param.copy_(torch.randn(param.shape, generator=g))


def test_model_with_alternating_layers_equals_eager_reference():
    torch.manual_seed(0)
    model = MoETransformer(_config())
    _randomise_biases_and_sinks(model)
    windows = [block.attn.core_attn.sliding_window for block in model.layers]
    assert windows == [3, None, 3, None]
    reference = copy.deepcopy(model)
    for block, window in zip(reference.layers, windows):
        block.attn.core_attn = EagerCoreAttention(window)
    tokens = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(2))
    logits, ref_logits = model(tokens), reference(tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    model.loss(tokens, targets).backward()
    reference.loss(tokens, targets).backward()
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, ref_params[name].grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # The sliding layers' window matters here (else the comparison could not see a wrong one).
    for block in reference.layers:
        block.attn.core_attn.window = None
    assert not torch.allclose(reference(tokens), ref_logits, atol=1e-4)


def test_parameters_are_named_and_counted():
    config = _config()
    with torch.device("meta"):
        model = MoETransformer(config)
    names = dict(model.named_parameters())
    assert names["layers.0.attn.sinks"].shape == (HEADS,)
    assert names["layers.0.attn.o_proj.bias"].shape == (HIDDEN,)
    assert "layers.0.attn.q_proj.bias" not in names
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()
    plain = _config(attention_out_bias=False, attention_sinks=False, sliding_window=None, layer_types=None)
    assert config.num_parameters() - plain.num_parameters() == config.num_layers * (HIDDEN + HEADS)


def test_meta_build_then_reset_equals_direct_build():
    torch.manual_seed(5)
    direct = MoETransformer(_config())
    torch.manual_seed(5)
    with torch.device("meta"):
        lazy = MoETransformer(_config())
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    for (name, want), got in zip(direct.state_dict().items(), lazy.state_dict().values()):
        assert torch.equal(want, got), name
    sinks = direct.layers[0].attn.sinks
    assert sinks.abs().sum() > 0 and not torch.equal(sinks, direct.layers[1].attn.sinks)  # drawn per layer
    assert torch.equal(direct.layers[0].attn.o_proj.bias, torch.zeros(HIDDEN))  # zeros, as transformers


def test_attention_module_defaults_keep_the_old_parameters():
    attention = Attention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM)
    assert attention.sinks is None and attention.o_proj.bias is None
    assert attention.core_attn.sliding_window is None


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"sliding_window": 0}, r"sliding_window=0 must be an integer >= 1"),
        ({"layer_types": None}, r"sliding_window=3 is set but layer_types is None"),
        ({"layer_types": ["full_attention"] * 3}, r"layer_types needs num_layers=4 entries.* got 3 entries"),
        ({"layer_types": ["sliding", "full", "full", "full"]}, r"each one of \['full_attention', 'sliding_attention'\]"),
        ({"sliding_window": None}, r"'sliding_attention' layers but sliding_window is None"),
        (
            {"attention": "mla", "num_kv_heads": None, "head_dim": None, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
             "qk_rope_head_dim": 8, "v_head_dim": 8},
            r"attention_out_bias, attention_sinks, layer_types with 'sliding_attention' are not supported with "
            r"attention='mla'",
        ),
    ],
)
def test_bad_configs_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(**overrides)


@pytest.mark.parametrize("modules", [["core_attn"], ["attention"]])
def test_selective_recompute_keeps_the_gradients(modules):
    # The sinks reach the core attention as an argument: checkpointing it must pass them through.
    torch.manual_seed(0)
    model = MoETransformer(_config())
    _randomise_biases_and_sinks(model)
    recomputed = copy.deepcopy(model)
    handle = apply_selective_recompute(recomputed, modules)
    assert len(handle.modules[modules[0]]) == 4, handle.modules  # every layer's, or the test shows nothing
    tokens = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    recomputed.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    plain = dict(model.named_parameters())
    for name, param in recomputed.named_parameters():
        torch.testing.assert_close(param.grad, plain[name].grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_export_to_a_family_without_windows_is_refused(tmp_path):
    # Mixtral's config.json here holds no per-layer windows: writing one would load as full attention.
    config = _config(attention_out_bias=False, attention_sinks=False, first_dense_layers=0, ffn_hidden_size=None)
    with pytest.raises(ValueError, match=r"sliding-window layers .*sliding_window=3.* mixtral export writes every"):
        MoETransformer(config).save_pretrained(tmp_path, family="mixtral")


@pytest.mark.parametrize("window", [None, 1, 3, 5])
def test_core_attention_equals_transformers_gpt_oss_attention(window):
    """``transformers``' own GPT-OSS eager attention and mask function, where the test extra installs it."""
    pytest.importorskip("transformers", reason="the test extra installs transformers")
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v, sinks, grad = _qkv()
    mask_function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    positions = torch.arange(SEQ)
    zero = torch.tensor(0)  # transformers' mask functions take index tensors (vmapped or broadcast)
    visible = mask_function(zero, zero, positions[:, None], positions[None, :]).expand(SEQ, SEQ)
    additive = torch.zeros(SEQ, SEQ, dtype=torch.float64).masked_fill(~visible, float("-inf"))
    stub = nn.Module()  # what eager_attention_forward reads of its GptOssAttention
    stub.sinks, stub.num_key_value_groups = nn.Parameter(sinks.double()), HEADS // KV_HEADS
    stub.eval()
    wide = [t.double().requires_grad_() for t in (q, k, v)]
    want, _ = eager_attention_forward(stub, *wide, additive[None, None], HEAD_DIM**-0.5)
    want = want.transpose(1, 2)  # transformers returns [B, S, heads, D]
    want.backward(grad.double())
    inputs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    got = CoreAttention(sliding_window=window)(*inputs)
    got.backward(grad)
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-6)
    for name, ours, theirs in zip(("q", "k", "v", "sinks"), inputs, (*wide, stub.sinks)):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"d{n}: {m}")
