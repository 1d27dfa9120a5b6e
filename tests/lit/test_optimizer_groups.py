"""AdamW's parameter groups: which parameters decay, for every kind of parameter the model can have.

Oracle: the rule written out by name here (weight matrices decay; norms, biases — the experts'
stacked ``[E, H]`` / ``[E, 2, F]`` ones included —, attention sinks and the embedding do not).
"""

from __future__ import annotations

from lightning_moe import MoEConfig
from lightning_moe.lit.optimization import optimizer_param_groups
from lightning_moe.models import MoETransformer, MoETransformerConfig

DECAYING = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "router.weight", "fc1_weight",
            "fc2_weight", "lm_head.weight")


def test_only_weight_matrices_decay():
    moe = MoEConfig(32, 16, 4, top_k=2, activation="clamped_swiglu", fc1_bias=True, fc2_bias=True, router_bias=True)
    model = MoETransformer(MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, max_seq_len=16, moe=moe,
        attention_bias=True, attention_out_bias=True, attention_sinks=True,
    ))
    decay, no_decay = optimizer_param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decayed == {n for n in names.values() if n.endswith(DECAYING)}, sorted(decayed)
    kept = {names[id(p)] for p in no_decay["params"]}
    for stacked in ("layers.0.ffn.experts.fc1_bias", "layers.0.ffn.experts.fc2_bias", "layers.0.attn.sinks",
                    "layers.0.attn.o_proj.bias", "layers.0.ffn.router.bias", "embed.weight"):
        assert stacked in kept, (stacked, sorted(kept))
