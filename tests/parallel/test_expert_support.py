"""Expert parallelism refuses a model whose MoE blocks it would not shard (they would stay replicated).

A LightningModule wrapping ``transformers.MixtralForCausalLM`` (``MixtralSparseMoeBlock``, not
``MoELayer``) under ``MoEStrategy(expert_parallel_size=2)`` would train as plain data parallelism
while the layout claims EP=2. The refusal must name the blocks and the way out, before launch
(``lightning-moe``'s pre-launch check on a meta-device copy) and at setup on every rank (2 forked
gloo ranks), where the strategy's layout banner must not have been printed. A model without any
``MoELayer`` is refused at EP=2 too; the layouts that do shard (or have nothing to lay out: EP=1,
a dense model under TP) are accepted.
"""

from __future__ import annotations

import importlib
import logging
import re

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from strategies.toy import ToyModule, quiet_trainer_kwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe.cli import check_layout_before_launch
from lightning_moe.parallel import ParallelDims
from lightning_moe.parallel.expert_support import HF_SPARSE_MOE_BLOCKS, expert_parallel_support_problem
from lightning_moe.parallel.layout.check import LayoutError
from lightning_moe.strategies import MoEStrategy

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

HF_REFUSAL = r"Hugging Face sparse-MoE blocks: 2 MixtralSparseMoeBlock \(Mixtral\).*lightning_moe\.MoELayer"


class HFMixtral(L.LightningModule):
    """A LightningModule around a tiny ``transformers.MixtralForCausalLM`` (2 layers of 4 experts)."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.MixtralConfig(
            vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
        )
        self.model = transformers.MixtralForCausalLM(config)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Dense(L.LightningModule):
    """No MoE layer at all."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)


MODELING = {"MixtralSparseMoeBlock": "mixtral", "Qwen2MoeSparseMoeBlock": "qwen2_moe",
            "Qwen3MoeSparseMoeBlock": "qwen3_moe", "OlmoeSparseMoeBlock": "olmoe", "DeepseekV3MoE": "deepseek_v3",
            "GptOssMLP": "gpt_oss", "Glm4MoeMoE": "glm4_moe"}


@pytest.mark.parametrize("name", sorted(HF_SPARSE_MOE_BLOCKS))
def test_the_names_are_transformers_own(name):
    # Recognised by class name (no transformers import at setup): each must be the block of its family.
    module = importlib.import_module(f"transformers.models.{MODELING[name]}.modeling_{MODELING[name]}")
    assert isinstance(getattr(module, name), type)


def test_hf_blocks_and_models_without_moe_layers_are_refused_before_launch():
    strategy = MoEStrategy(expert_parallel_size=2, parallel_devices=[torch.device("cpu")] * 2)
    with pytest.raises(LayoutError, match=HF_REFUSAL):
        check_layout_before_launch(HFMixtral(), strategy)
    with pytest.raises(LayoutError, match=r"Dense has none: nothing would be sharded"):
        check_layout_before_launch(Dense(), strategy)
    etp = MoEStrategy(expert_tensor_parallel_size=2, parallel_devices=[torch.device("cpu")] * 2)
    with pytest.raises(LayoutError, match=r"expert_tensor_parallel_size=2 shards the experts"):
        check_layout_before_launch(HFMixtral(), etp)


def test_layouts_that_shard_or_have_nothing_to_lay_out_are_accepted():
    assert expert_parallel_support_problem(HFMixtral(), ParallelDims(2)) is None  # plain data parallelism
    assert expert_parallel_support_problem(ToyModule(), ParallelDims(2, ep=2)) is None
    assert expert_parallel_support_problem(Dense(), ParallelDims(2, tp=2)) is None  # ETP=TP by default


def _fit_hf_model(rank: int, world_size: int) -> str:
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("lightning.pytorch").addHandler(handler)
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=world_size, strategy=MoEStrategy(expert_parallel_size=2),
                                               max_steps=1))
    tokens = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
    try:
        trainer.fit(HFMixtral(), DataLoader(TensorDataset(tokens), batch_size=2))
    except ValueError as err:
        assert not [m for m in logged if m.startswith("MoEStrategy: world")], logged  # no banner for it
        return str(err)
    return "trained without an error"


@pytest.mark.distributed
def test_the_strategy_refuses_hf_blocks_at_setup(tmp_path):
    for message in run_distributed(_fit_hf_model, 2, tmp_dir=tmp_path, timeout_s=120):
        assert re.search(HF_REFUSAL, message), message
