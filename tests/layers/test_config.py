"""Tests of `MoEConfig`: every validation error (with its message) and the accepted forms."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.moe import MoELayer

BASE = {"hidden_size": 8, "ffn_hidden_size": 8, "num_experts": 8}


def _config(**overrides) -> MoEConfig:
    return MoEConfig(**{**BASE, **overrides})


INVALID_CONFIGS = [
    pytest.param({"top_k": 9}, "top_k=9 exceeds num_experts=8", id="top-k-above-experts"),
    pytest.param(
        {"num_groups": 4, "group_top_k": 5, "top_k": 8},
        "group_top_k=5 must be between 1 and num_groups=4",
        id="group-top-k-above-groups",
    ),
    pytest.param(
        {"num_groups": 3, "group_top_k": 1},
        "num_experts=8 is not divisible by num_groups=3",
        id="experts-not-divisible-by-groups",
    ),
    pytest.param(
        {"pad_to_capacity": True}, "pad_to_capacity=True needs a capacity_factor", id="pad-without-capacity"
    ),
    pytest.param({"score_func": "relu"}, "Unknown score_func 'relu'", id="unknown-score-func"),
    pytest.param({"activation": "tanh"}, "Unknown activation 'tanh'", id="unknown-activation"),
    pytest.param(
        {"expert_bias": True},
        "expert_bias=True needs score_func 'sigmoid' or 'sqrtsoftplus'",
        id="expert-bias-with-softmax",
    ),
    pytest.param({"top_k": 1}, "Set pre_softmax=True", id="softmax-top1-without-pre-softmax"),
    pytest.param(
        {"load_balancing": ["aux_loss", "seq_aux_loss"], "aux_loss_coeff": [1e-2]},
        "aux_loss_coeff has 1 entries but load_balancing has 2",
        id="wrong-number-of-aux-coefficients",
    ),
    pytest.param({"hidden_size": 0}, "MoEConfig.hidden_size must be >= 1, got 0.", id="hidden-size-zero"),
    pytest.param({"ffn_hidden_size": 0}, "MoEConfig.ffn_hidden_size must be >= 1, got 0.", id="ffn-zero"),
    pytest.param({"num_experts": 0}, "MoEConfig.num_experts must be >= 1, got 0.", id="no-experts"),
    pytest.param({"top_k": 0}, "MoEConfig.top_k must be >= 1, got 0.", id="top-k-zero"),
    pytest.param(
        {"score_func": "sigmoid", "pre_softmax": True},
        "pre_softmax=True only applies to score_func='softmax'",
        id="pre-softmax-with-sigmoid",
    ),
    pytest.param({"router_dtype": "bf16"}, "Unknown router_dtype 'bf16'", id="unknown-router-dtype"),
    pytest.param(
        {"num_groups": 4},
        "Group-limited routing needs both num_groups and group_top_k",
        id="groups-without-top-k",
    ),
    pytest.param(
        {"num_groups": 4, "group_top_k": 3, "top_k": 2},
        "group_top_k=3 exceeds top_k=2",
        id="group-top-k-above-top-k",
    ),
    pytest.param(
        {"num_groups": 4, "group_top_k": 1, "top_k": 3},
        "top_k=3 exceeds the 2 experts in group_top_k=1 groups of 2",
        id="top-k-above-reachable-experts",
    ),
    pytest.param(
        {"load_balancing": ["switch"]}, "Unknown load_balancing type(s) ['switch']", id="unknown-balancing"
    ),
    pytest.param(
        {"load_balancing": ["aux_loss", "aux_loss"]},
        "load_balancing lists a type twice",
        id="duplicate-balancing",
    ),
    pytest.param(
        {"load_balancing": ["aux_loss"], "aux_loss_coeff": -1e-2},
        "Loss coefficients must be >= 0.",
        id="negative-aux-coeff",
    ),
    pytest.param({"z_loss_coeff": -1e-3}, "Loss coefficients must be >= 0.", id="negative-z-loss-coeff"),
    pytest.param(
        {"aux_loss_coeff": 1e-2},
        "aux_loss_coeff=0.01 is set but load_balancing=[] enables no auxiliary loss",
        id="aux-coeff-without-load-balancing",
    ),
    pytest.param(
        {"aux_loss_coeff": [1e-2, 1e-3]},
        "aux_loss_coeff=[0.01, 0.001] is set but load_balancing=[] enables no auxiliary loss",
        id="aux-coeff-list-without-load-balancing",
    ),
    pytest.param(
        {"aux_loss_coeff": -1e-2},
        "aux_loss_coeff=-0.01 is set but load_balancing=[] enables no auxiliary loss",
        id="negative-aux-coeff-without-load-balancing",
    ),
    pytest.param({"drop_policy": "random"}, "Unknown drop_policy 'random'", id="unknown-drop-policy"),
    pytest.param({"capacity_factor": 0.0}, "capacity_factor=0.0 must be > 0", id="zero-capacity-factor"),
    pytest.param(
        {"capacity_factor": 5.0, "pad_to_capacity": True},
        "capacity_factor=5.0 > num_experts/top_k=4 with pad_to_capacity",
        id="pad-with-capacity-above-experts-over-k",
    ),
    pytest.param(
        {"router_padding_alignment": 0}, "router_padding_alignment must be >= 1, got 0.", id="zero-alignment"
    ),
    pytest.param(
        {"router_padding_alignment": 16, "capacity_factor": 1.0, "pad_to_capacity": True},
        "router_padding_alignment and pad_to_capacity both pad",
        id="alignment-with-pad-to-capacity",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), INVALID_CONFIGS)
def test_invalid_config_raises(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _config(**overrides)


def test_defaults_are_megatron_like_and_valid():
    config = _config()
    assert (config.top_k, config.score_func, config.pre_softmax) == (2, "softmax", False)
    assert (config.activation, config.router_dtype, config.capacity_factor) == ("swiglu", "fp32", None)
    assert config.load_balancing == [] and config.aux_loss_coeffs == {}


def test_load_balancing_string_and_coefficients():
    single = _config(load_balancing="seq_aux_loss", aux_loss_coeff=1e-4)
    assert single.load_balancing == ["seq_aux_loss"]
    assert single.aux_loss_coeffs == {"seq_aux_loss": 1e-4}
    broadcast = _config(load_balancing=["aux_loss", "global_aux_loss"], aux_loss_coeff=1e-2)
    assert broadcast.aux_loss_coeffs == {"aux_loss": 1e-2, "global_aux_loss": 1e-2}
    per_type = _config(load_balancing=("aux_loss", "seq_aux_loss"), aux_loss_coeff=[1e-2, 1e-3])
    assert per_type.load_balancing == ["aux_loss", "seq_aux_loss"]
    assert per_type.aux_loss_coeffs == {"aux_loss": 1e-2, "seq_aux_loss": 1e-3}


def test_aux_coeff_without_load_balancing_names_the_fix():
    with pytest.raises(ValueError) as error:
        _config(aux_loss_coeff=1e-3)
    message = str(error.value)
    assert "load_balancing=['aux_loss']" in message  # Megatron's default type
    assert "aux_loss_coeff=0.0" in message  # or no auxiliary loss at all


def test_zero_coefficients_are_accepted_and_turn_the_loss_off():
    """A coefficient of 0 is Megatron's way to switch a loss off; nothing is silently lost."""
    assert _config(aux_loss_coeff=0.0).aux_loss_coeffs == {}
    assert _config(aux_loss_coeff=0).aux_loss_coeffs == {}
    assert _config(aux_loss_coeff=[]).aux_loss_coeffs == {}
    assert _config(load_balancing=["aux_loss"], aux_loss_coeff=0.0).aux_loss_coeffs == {"aux_loss": 0.0}
    all_types = ["aux_loss", "seq_aux_loss", "global_aux_loss"]
    mixed = _config(load_balancing=all_types, aux_loss_coeff=[1e-2, 0.0, 1e-3])
    assert mixed.aux_loss_coeffs == {"aux_loss": 1e-2, "seq_aux_loss": 0.0, "global_aux_loss": 1e-3}


def test_boundary_configs_are_accepted():
    _config(top_k=8)  # every expert
    _config(top_k=1, pre_softmax=True)
    _config(top_k=1, score_func="sigmoid")
    _config(num_groups=8, group_top_k=2, top_k=2)  # one expert per group
    _config(capacity_factor=4.0, pad_to_capacity=True)  # exactly E / K
    _config(score_func="sqrtsoftplus", expert_bias=True, router_dtype=None)


@st.composite
def _config_kwargs(draw) -> dict:
    """Mostly valid settings (dependent choices drawn consistently); the rest is filtered out."""
    num_experts = draw(st.sampled_from([1, 2, 4, 6, 8]))
    top_k = draw(st.integers(1, min(num_experts, 4)))
    score_func = draw(st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]))
    groups = draw(st.sampled_from([None, (2, 1), (2, 2), (3, 1), (4, 2)]))
    capacity_factor, pad = draw(st.sampled_from([(None, False), (0.5, False), (1.0, True), (2.0, False)]))
    return {
        "num_experts": num_experts,
        "top_k": top_k,
        "score_func": score_func,
        "pre_softmax": score_func == "softmax" and (top_k == 1 or draw(st.booleans())),
        "expert_bias": score_func != "softmax" and draw(st.booleans()),
        "num_groups": groups and groups[0],
        "group_top_k": groups and groups[1],
        "capacity_factor": capacity_factor,
        "pad_to_capacity": pad,
        "drop_policy": draw(st.sampled_from(["probs", "position"])),
        "router_padding_alignment": None if pad else draw(st.sampled_from([None, 4])),
    }


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
@given(kwargs=_config_kwargs(), num_tokens=st.integers(1, 12))
def test_every_accepted_config_runs_forward_and_backward(kwargs, num_tokens):
    """Validation is complete: a config MoEConfig accepts never fails inside the layer."""
    try:
        config = _config(**kwargs)
    except ValueError:
        assume(False)
    layer = MoELayer(config)
    x = torch.randn(num_tokens, BASE["hidden_size"], requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == x.shape and bool(torch.isfinite(out).all()) and bool(torch.isfinite(x.grad).all())


def test_help_shows_every_field_docstring():
    """``help(MoEConfig)`` (pydoc) lists the fields with their docstrings, as --help and IDEs do."""
    import pydoc

    from lightning_moe.layers.field_docs import field_docstrings
    from lightning_moe.models import MoETransformerConfig

    for cls in (MoEConfig, MoETransformerConfig):
        text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
        docs = field_docstrings(cls)
        assert docs and set(docs) == {f.name for f in dataclasses.fields(cls)}
        for name, doc in docs.items():
            assert f"{name}: {doc.splitlines()[0]}" in text, name
