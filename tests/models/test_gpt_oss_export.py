"""A GPT-OSS run: ``init_from`` an MXFP4 directory, one training step, ``lightning-moe export --format hf``.

Oracle: ``transformers``. The first step's loss must be the cross-entropy of ``transformers``'
dequantised model's logits on the batch (fp32, 1e-5 relative); the exported directory must load
in ``transformers`` as ``GptOssForCausalLM`` without quantisation (the weights written
dequantised, no ``quantization_config``) and give the trained model's logits (1e-5 of their
scale), its ``config.json`` otherwise the source's key by key.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from helpers.asserts import assert_close_to_scale
from helpers.gpt_oss import random_gpt_oss, write_mxfp4_directory
from strategies.toy import quiet_trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe.cli import cli_main
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models.transformer import next_token_loss

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
pytest.importorskip("safetensors", reason="the hf and test extras install safetensors")
pytest.importorskip("transformers.models.gpt_oss", reason="needs transformers' gpt_oss")

VOCAB, SEQ, BATCH = 64, 12, 2
TOL = 1e-5


class FirstStep(MoELanguageModel):
    """Records the first training step's batch and loss."""

    first: dict | None = None

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.first is None:
            inputs, targets = batch
            self.first = {"inputs": inputs.clone(), "targets": targets.clone(), "loss": loss.detach().clone()}
        return loss


def _source(path) -> None:
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, max_position_embeddings=64, initializer_range=0.1,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, swiglu_limit=1.0, bos_token_id=0, eos_token_id=2, pad_token_id=1,
    )
    random_gpt_oss(config, seed=4).save_pretrained(path / "plain")
    write_mxfp4_directory(path / "plain", path / "mxfp4")


def test_mxfp4_run_exports_a_plain_gpt_oss_directory(tmp_path):
    _source(tmp_path)
    source = tmp_path / "mxfp4"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        source, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    module = FirstStep(init_from=str(source), learning_rate=1e-2, warmup_steps=0)
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=1, max_steps=1), limit_val_batches=0)
    trainer.fit(module, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH))
    first = module.first
    with torch.no_grad():
        want = next_token_loss(theirs(input_ids=first["inputs"]).logits, first["targets"])
    torch.testing.assert_close(first["loss"], want, rtol=TOL, atol=0.0)

    checkpoint = tmp_path / "run.ckpt"
    trainer.save_checkpoint(checkpoint)
    cli_main(["export", str(checkpoint), str(tmp_path / "export"), "--format", "hf"])
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(exported).__name__ == "GptOssForCausalLM"
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    original = json.loads((source / "config.json").read_text())
    original.pop("quantization_config")
    assert written == original
    probe = tokens[:, :SEQ]
    with torch.no_grad():
        expected = module.model.eval()(probe)
        assert_close_to_scale(exported(input_ids=probe).logits, expected, TOL, "exported logits")
    # The step changed the weights: the export is the trained model, not the source.
    assert not torch.allclose(theirs(input_ids=probe).logits, expected, atol=1e-6, rtol=0.0)
