"""Where `MoELanguageModel.configure_model` builds the transformer: on the meta device under
``MoEStrategy`` (which shards it before giving this rank's part storage), with storage elsewhere.

Oracle: a transformer built directly from the same seed. In one process, no launch: the Trainers
are only constructed (``configure_model`` reads the strategy's type).
"""

from __future__ import annotations

import lightning as L
import torch

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.strategies import MoEStrategy

CONFIG = MoETransformerConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64,
    first_dense_layers=1, moe=MoEConfig(32, 16, 4, top_k=2),
)


def _configured(trainer: L.Trainer) -> MoELanguageModel:
    torch.manual_seed(0)
    module = MoELanguageModel(CONFIG)
    module.trainer = trainer
    module.configure_model()
    return module


def test_under_moe_strategy_nothing_is_allocated():
    """Every tensor of the transformer is on the meta device; the seeds it will be drawn from are those
    of a direct build."""
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEStrategy(), logger=False)
    module = _configured(trainer)
    tensors = [*module.model.named_parameters(), *module.model.named_buffers()]
    allocated = [name for name, tensor in tensors if not tensor.is_meta]
    assert tensors and not allocated, f"{len(allocated)} of {len(tensors)} tensors have storage: {allocated[:3]}"
    torch.manual_seed(0)
    direct = MoETransformer(CONFIG)
    assert module.model.init_seed == direct.init_seed
    seeds = [m.init_seed for m in module.model.modules() if hasattr(m, "init_seed")]
    assert seeds == [m.init_seed for m in direct.modules() if hasattr(m, "init_seed")]


def test_plain_trainer_builds_the_weights():
    """Without MoEStrategy nothing changes: the transformer has its weights, those of a direct build."""
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    module = _configured(trainer)
    torch.manual_seed(0)
    direct = MoETransformer(CONFIG).state_dict()
    state = module.model.state_dict()
    assert state.keys() == direct.keys()
    for key, value in direct.items():
        assert not state[key].is_meta and torch.equal(state[key], value), key
