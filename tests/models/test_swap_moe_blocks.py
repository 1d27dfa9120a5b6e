"""`swap_moe_blocks` / `unswap_moe_blocks` on tiny random ``transformers`` models of every supported family.

Oracle: ``transformers``' own model. After the swap its logits are unchanged (fp32, 1e-5 of their
scale) with every MoE block a `MoELayer`; after changing the swapped layers' weights (as training
would), putting the blocks back, ``save_pretrained`` and the original class's ``from_pretrained``,
the loaded model gives the swapped model's logits.
"""

from __future__ import annotations

import pytest
import torch
from helpers.asserts import assert_close_to_scale
from helpers.hf_swap import SWAP_FAMILIES, VOCAB, tiny_moe_model

from lightning_moe import MoELayer, swap_moe_blocks, unswap_moe_blocks

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

# fp32 forwards through differently blocked kernels (the grouped expert GEMMs, softmax of the
# top-k logits instead of renormalised top-k probabilities): ulps of the logits.
LOGITS_TOL = 1e-5


def _tokens() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_tokens()).logits


def _moe_blocks(model) -> dict[str, str]:
    """Name -> class name of the modules that hold routed experts."""
    return {name: type(m).__name__ for name, m in model.named_modules() if "experts" in m._modules}


@pytest.mark.parametrize("family", SWAP_FAMILIES)
def test_swap_keeps_the_logits(family):
    model = tiny_moe_model(family)
    before, blocks = _logits(model), _moe_blocks(model)
    parameters = sum(p.numel() for p in model.parameters())

    names = swap_moe_blocks(model)

    assert sorted(names) == sorted(blocks)
    assert all(isinstance(model.get_submodule(name), MoELayer) for name in names)
    assert sum(p.numel() for p in model.parameters()) == parameters  # every weight moved, none added
    assert_close_to_scale(_logits(model), before, LOGITS_TOL, f"{family} logits after the swap")


@pytest.mark.parametrize("family", SWAP_FAMILIES)
def test_swap_back_save_and_load_in_transformers(family, tmp_path):
    model = tiny_moe_model(family)
    original_class, blocks = type(model), _moe_blocks(model)
    swap_moe_blocks(model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # stands for training: every MoE tensor changes, the expert bias included
        for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
            for tensor in (*layer.parameters(), *(b for b in [layer.router.expert_bias] if b is not None)):
                tensor.add_(0.05 * torch.randn(tensor.shape, generator=generator))
    trained = _logits(model)

    assert sorted(unswap_moe_blocks(model)) == sorted(blocks)
    assert _moe_blocks(model) == blocks
    model.save_pretrained(tmp_path)
    loaded = original_class.from_pretrained(tmp_path).eval()

    assert type(loaded) is original_class
    assert_close_to_scale(_logits(loaded), trained, LOGITS_TOL, f"{family} logits after save_pretrained")


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe"])
def test_swap_and_back_keeps_every_tensor_bit_for_bit_in_bf16(family):
    """Inside a wrapper module (as in a LightningModule); the router computes in fp32 meanwhile."""
    model = tiny_moe_model(family).to(torch.bfloat16)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    wrapper = torch.nn.ModuleDict({"lm": model})
    swap_moe_blocks(wrapper)
    assert all(m.router.weight.dtype == torch.float32 for m in model.modules() if isinstance(m, MoELayer))
    unswap_moe_blocks(wrapper)
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name


def test_unsupported_blocks_are_named_and_nothing_changes():
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"does not support the MoE block\(s\) transformers\.models\.gpt_oss\.modeling_"
                                         r"gpt_oss\.GptOssMLP at model\.layers\.0\.mlp, model\.layers\.1\.mlp\. "
                                         r"Supported blocks: MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock"):
        swap_moe_blocks(model)
    assert not any(isinstance(m, MoELayer) for m in model.modules())


def test_a_model_without_moe_blocks_is_refused():
    with pytest.raises(ValueError, match=r"No transformers sparse-MoE block found in Sequential; supported blocks: "
                                         r"MixtralSparseMoeBlock"):
        swap_moe_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_output_router_logits_is_refused_before_anything_changes():
    model = tiny_moe_model("mixtral", output_router_logits=True)
    with pytest.raises(ValueError, match=r"MixtralConfig\.output_router_logits=True.*output_router_logits = False"):
        swap_moe_blocks(model)
    assert not any(isinstance(m, MoELayer) for m in model.modules())


def test_overrides_set_training_losses_and_unknown_ones_are_named():
    model = tiny_moe_model("qwen3_moe")
    swap_moe_blocks(model, load_balancing=["aux_loss"], aux_loss_coeff=1e-2)
    layer = model.model.layers[0].mlp
    assert layer.config.load_balancing == ["aux_loss"] and layer.config.aux_loss_coeffs == {"aux_loss": 1e-2}
    with pytest.raises(TypeError, match=r"Unknown MoEConfig field\(s\) \['aux_coeff'\]"):
        swap_moe_blocks(tiny_moe_model("qwen3_moe"), aux_coeff=1.0)


def test_a_layer_without_a_place_in_the_block_is_not_written_back():
    model = tiny_moe_model("mixtral")
    swap_moe_blocks(model, expert_bias=True, score_func="sigmoid")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp: \['router\.expert_bias'\] of the MoELayer have no "
                                         r"place in transformers' MixtralSparseMoeBlock"):
        unswap_moe_blocks(model)


def test_unswap_needs_swapped_layers():
    with pytest.raises(ValueError, match=r"MixtralForCausalLM has no MoELayer made by swap_moe_blocks"):
        unswap_moe_blocks(tiny_moe_model("mixtral"))
