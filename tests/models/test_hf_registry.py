"""The Hugging Face family registry: one file per family, and the shared machinery reads only the registry.

Oracles: the files of ``lightning_moe/models/hf/families/`` (each registers exactly one family),
and OLMoE's own mapping, which a renamed copy of its :class:`Family` registered at run time must
reproduce through the same shared functions (``config_from_hf``, ``config_to_hf``, the weight names)
without any of them naming it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from lightning_moe.cli import export_parser
from lightning_moe.models.hf import config_from_hf, config_to_hf, infer_family, registry
from lightning_moe.models.hf.families import FAMILIES, OLMOE, family, model_families, register_family
from lightning_moe.models.hf.weights import hf_tensors

FAMILY_DIR = Path(registry.__file__).parent / "families"


def _olmoe_raw(model_type: str = "olmoe") -> dict:
    return {
        "model_type": model_type, "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 8, "num_experts": 4,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 32,
    }


@pytest.fixture
def olmoe_copy():
    """OLMoE registered again as ``olmoe_copy``, removed afterwards."""
    spec = register_family(dataclasses.replace(OLMOE, name="olmoe_copy", title="OLMoE copy"))
    try:
        yield spec
    finally:
        registry._REGISTRY.pop(spec.name)


def test_each_family_file_registers_its_family():
    files = {path.stem for path in FAMILY_DIR.glob("*.py") if path.stem != "__init__"}
    assert set(FAMILIES) == files
    assert all(family(name).name == name for name in files)


def test_cli_family_choices_are_the_registry_whole_model_families():
    (action,) = [a for a in export_parser()._actions if "--family" in a.option_strings]
    assert list(action.choices) == list(model_families())
    assert set(model_families()) == {name for name, spec in FAMILIES.items() if spec.architecture is not None}


def test_a_family_registered_later_maps_like_the_one_it_copies(olmoe_copy):
    config, name = config_from_hf(_olmoe_raw("olmoe_copy"))
    expected, _ = config_from_hf(_olmoe_raw())
    assert name == "olmoe_copy" and config == expected
    written = config_to_hf(config, "olmoe_copy", torch.float32)
    assert written == {**config_to_hf(expected, "olmoe", torch.float32), "model_type": "olmoe_copy"}
    assert "olmoe_copy" in model_families()
    assert infer_family(config) == "olmoe"  # the first registered family computing this attention


def test_weight_names_come_from_the_family():
    state = {"layers.0.ffn.experts.fc1_weight": torch.zeros(2, 2, 3, 4), "layers.0.ffn.experts.fc2_weight": torch.zeros(2, 4, 3)}
    config, _ = config_from_hf({**_olmoe_raw(), "model_type": "mixtral", "num_local_experts": 2})
    names = set(hf_tensors(state, config, "mixtral"))
    gate, up, down = family("mixtral").expert_names
    prefix = f"model.layers.0.{family('mixtral').moe_prefix}.experts"
    assert names == {f"{prefix}.{e}.{proj}.weight" for e in range(2) for proj in (gate, up, down)}


def test_register_family_refuses_a_duplicate_or_an_incomplete_whole_model_family():
    with pytest.raises(ValueError, match="already registered"):
        register_family(OLMOE)
    with pytest.raises(ValueError, match="has no model_config, export_problems, export_fields"):
        register_family(dataclasses.replace(OLMOE, name="half", model_config=None, export_problems=None,
                                            export_fields=None))
    assert "half" not in FAMILIES


def test_unknown_family_is_named_with_the_registered_ones():
    with pytest.raises(ValueError, match=r"Unknown Hugging Face family 'llama'; registered families: deepseek_v3"):
        family("llama")
