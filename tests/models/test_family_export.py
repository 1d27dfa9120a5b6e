"""Qwen2-MoE and GLM-4.5 runs: ``init_from`` a directory, one training step, ``lightning-moe export --format hf``.

Oracle: ``transformers``. The first step's loss must be the cross-entropy of ``transformers``'
logits on the batch (fp32, 1e-5 relative); the exported directory must load in ``transformers`` as
the source's class and give the trained model's logits (1e-5 of their scale), with the source's
``config.json`` written back unchanged. (GPT-OSS: ``test_gpt_oss_export.py``.)
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from helpers.asserts import assert_close_to_scale
from helpers.hf import random_hf_model
from strategies.toy import quiet_trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe.cli import cli_main
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models.transformer import next_token_loss

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
pytest.importorskip("safetensors", reason="the hf and test extras install safetensors")

VOCAB, SEQ, BATCH, TOL = 64, 12, 2, 1e-5


class _FirstStep(MoELanguageModel):
    first: dict | None = None

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.first is None:
            self.first = {"inputs": batch[0].clone(), "targets": batch[1].clone(), "loss": loss.detach().clone()}
        return loss


def _config(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, max_position_embeddings=64, initializer_range=0.1,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                  moe_intermediate_size=16, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, shared_expert_intermediate_size=24, num_experts=4,
                                           num_experts_per_tok=2, qkv_bias=True)
    return transformers.Glm4MoeConfig(**common, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                      first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.0,
                                      use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5)


@pytest.mark.parametrize("family", ["qwen2_moe", "glm4_moe"])
def test_a_run_exports_a_directory_transformers_loads(tmp_path, family):
    source = tmp_path / "source"
    theirs = random_hf_model(_config(family), seed=4)
    theirs.save_pretrained(source)
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    module = _FirstStep(init_from=str(source), learning_rate=1e-2, warmup_steps=0)
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=1, max_steps=1), limit_val_batches=0)
    trainer.fit(module, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH))
    with torch.no_grad():
        want = next_token_loss(theirs(input_ids=module.first["inputs"]).logits, module.first["targets"])
    torch.testing.assert_close(module.first["loss"], want, rtol=TOL, atol=0.0)

    trainer.save_checkpoint(tmp_path / "run.ckpt")
    cli_main(["export", str(tmp_path / "run.ckpt"), str(tmp_path / "export"), "--format", "hf"])
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(exported) is type(theirs)
    assert json.loads((tmp_path / "export" / "config.json").read_text()) == json.loads(
        (source / "config.json").read_text())
    probe = tokens[:, :SEQ]
    with torch.no_grad():
        expected = module.model.eval()(probe)
        assert_close_to_scale(exported(input_ids=probe).logits, expected, TOL, f"{family} exported logits")
        assert not torch.allclose(theirs(input_ids=probe).logits, expected, atol=1e-6, rtol=0.0)  # trained
