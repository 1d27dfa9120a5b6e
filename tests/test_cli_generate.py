"""``lightning-moe generate CKPT --prompt TEXT``: greedy or sampled continuation, one process.

Oracle: a hand-rolled argmax loop over the trained model itself (the LightningModule of the
run, one CPU process), on the prompt encoded with the run's tokenizer. The checkpoint is the
consolidated file of a one-step fit with `TextDataModule` (byte tokenizer); sharded checkpoints of
other layouts are covered next to the export tests (``test_cli_export.py``), which read them
the same way. The command line is checked in-process through :func:`lightning_moe.cli.cli_main`.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_moe import MoEConfig
from lightning_moe.cli import cli_main
from lightning_moe.cli_generate import run_tokenizer
from lightning_moe.data import ByteTokenizer
from lightning_moe.lit import MoELanguageModel, TextDataModule
from lightning_moe.models import MoETransformerConfig

PROMPT = "the quick brown"
NEW = 6


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("generate")
    (root / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 30)
    torch.manual_seed(0)
    config = MoETransformerConfig(
        vocab_size=320, hidden_size=32, num_layers=1, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        max_seq_len=16, moe=MoEConfig(32, 16, 4, top_k=2),
    )
    module = MoELanguageModel(config, warmup_steps=1)
    data = TextDataModule(str(root / "a.txt"), seq_len=16, batch_size=2, val_fraction=0.0)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(root / "model.ckpt")
    return {"checkpoint": str(root / "model.ckpt"), "model": module.model.eval()}


def argmax_loop(model, ids: list[int], steps: int, context: int) -> list[int]:
    """The oracle: append the most likely next token ``steps`` times, the last ``context`` tokens fed."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids[-context:]]))[0, -1].argmax()))
    return ids


def _generate(checkpoint: str, *options: str):
    return cli_main(["generate", checkpoint, "--prompt", PROMPT, "--max_new_tokens", str(NEW), "--ignore_eos", *options])


def test_greedy_generation_equals_an_argmax_loop_over_the_trained_model(trained, capsys):
    prompt = ByteTokenizer().encode(PROMPT)
    expected = argmax_loop(trained["model"], prompt, NEW, context=16)[len(prompt):]  # the prompt + new > 16: cropped
    generated = _generate(trained["checkpoint"])
    assert generated.prompt_ids == prompt
    assert generated.new_ids == expected
    assert capsys.readouterr().out == ByteTokenizer().decode([t for t in expected if t < 259]) + "\n"


def test_sampling_is_reproducible_with_a_seed_and_top_k_1_is_greedy(trained):
    sampled = [_generate(trained["checkpoint"], "--temperature", "1.5", "--seed", "7").new_ids for _ in range(2)]
    assert sampled[0] == sampled[1]
    prompt = ByteTokenizer().encode(PROMPT)
    greedy = argmax_loop(trained["model"], prompt, NEW, context=16)[len(prompt):]
    assert _generate(trained["checkpoint"], "--temperature", "1.5", "--top_k", "1", "--seed", "3").new_ids == greedy


def test_the_run_tokenizer_is_the_recorded_one():
    assert isinstance(run_tokenizer({"datamodule_hyper_parameters": {"tokenizer": None}}), ByteTokenizer)
    assert isinstance(run_tokenizer({}), ByteTokenizer)
    with pytest.raises(FileNotFoundError, match=r"tokenizer /nowhere/tok does not exist here.*--tokenizer"):
        run_tokenizer({"datamodule_hyper_parameters": {"tokenizer": "/nowhere/tok"}})


def test_generate_errors_are_one_line_with_exit_status_1(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", str(tmp_path / "missing.ckpt"), "--prompt", "x"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("lightning-moe generate: error: Checkpoint ") and err.count("\n") == 1, err


def test_generate_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("CKPT", "--prompt", "--max_new_tokens", "--temperature", "--top_k", "--seed", "--tokenizer"):
        assert option in out, option
