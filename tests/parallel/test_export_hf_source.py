"""``export_hf`` of a model fine-tuned from ``init_from`` writes the source model back, not a new one.

Oracle: the ``init_from`` directory itself. After one training step with training-only overrides
(``max_seq_len`` 128 -> 32, another aux-loss coefficient), the exported ``config.json`` must equal
the source's key by key, and the tokenizer files and ``generation_config.json`` must be copied
byte for byte, so that ``AutoTokenizer.from_pretrained(export)`` has the source's vocabulary. A
tokenizer file gone from the source directory at export time is named in a warning. A real change
of the model (here ``norm_eps``) changes exactly its own key.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import lightning as L
import pytest
import torch
from helpers.hf import tiny_models
from strategies.toy import quiet_trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe.checkpoint.export_hf import export_hf
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models.hf import pretrained_config
from lightning_moe.models.hf.io import read_config
from lightning_moe.models.hf.source import exported_config

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
pytest.importorskip("safetensors", reason="the hf and test extras install safetensors")

OVERRIDES = {"max_seq_len": 32, "moe": {"aux_loss_coeff": 0.5}}
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(source directory, checkpoint file of one step from it)."""
    root = tmp_path_factory.mktemp("export_source")
    source = root / "source"
    tiny_models().make_tiny_model(source, "qwen3_moe", texts=["def f(x):\n    return x\n"] * 4)
    specials = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}
    (source / "special_tokens_map.json").write_text(json.dumps(specials))
    (source / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **specials}))
    module = MoELanguageModel(init_from=str(source), model_overrides=OVERRIDES, warmup_steps=0)
    assert module.config.max_seq_len == 32 != read_config(source)["max_position_embeddings"]
    tokens = torch.randint(3, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=1, max_steps=1), limit_val_batches=0)
    trainer.fit(module, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2))
    checkpoint = root / "trained.ckpt"
    trainer.save_checkpoint(checkpoint)
    return source, checkpoint


def test_export_keeps_the_source_config_and_tokenizer(trained, tmp_path):
    source, checkpoint = trained
    export_hf(checkpoint, tmp_path / "export")
    got, want = read_config(tmp_path / "export"), read_config(source)
    changed = {key: (got.get(key, "<absent>"), value) for key, value in want.items() if got.get(key, "<absent>") != value}
    assert not changed, f"(exported, source) of the keys that changed: {changed}"
    assert sorted(got) == sorted(want)
    for name in COPIED:
        assert (tmp_path / "export" / name).read_bytes() == (source / name).read_bytes(), name
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    original = transformers.AutoTokenizer.from_pretrained(source)
    assert len(original) > 3 and exported.get_vocab() == original.get_vocab()


def test_files_gone_from_the_source_are_named(trained, tmp_path):
    source, checkpoint = trained
    moved = tmp_path / "moved"
    shutil.copytree(source, moved)
    for name in ("tokenizer.json", "generation_config.json"):
        (source / name).unlink()
    try:
        with pytest.warns(UserWarning, match=r"export holds no tokenizer\.json, generation_config\.json: the init_from"):
            export_hf(checkpoint, tmp_path / "export")
    finally:
        for name in ("tokenizer.json", "generation_config.json"):
            shutil.copyfile(moved / name, source / name)
    assert (tmp_path / "export" / "tokenizer_config.json").is_file()


def test_a_real_change_of_the_model_changes_its_key_only(trained):
    source, _ = trained
    raw = read_config(source)
    config, family = pretrained_config(source)
    written = exported_config(dataclasses.replace(config, norm_eps=1e-3), family, torch.float32, source=raw)
    assert written == {**raw, "rms_norm_eps": 1e-3}
