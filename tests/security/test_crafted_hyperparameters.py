"""Crafted hyperparameters: nothing a checkpoint (or a ``model_overrides`` mapping) holds is built.

``lightning-moe fit --ckpt_path FILE`` merges the file's ``hyper_parameters`` into the
configuration (LightningCLI). A ``class_path`` mapping in them, or in ``model_overrides`` of a
configuration, must never become an object: the payload here is ``subprocess.Popen`` with a
shell command that only creates a marker file. The CLI runs in this process; each test checks the
refusal, that no marker exists (after giving a started shell time to write it) and that nothing
else under the test's folder changed (:func:`~security.crafting.snapshot`).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
from helpers.memory import peak_rss_growth
from security.crafting import snapshot

from lightning_moe import MoEConfig
from lightning_moe.cli import MoECLI, cli_main
from lightning_moe.cli_ckpt_hparams import checkpoint_hyperparameters
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models import MoETransformerConfig
from lightning_moe.parallel.config_error import ConfigError


def _payload(marker: Path) -> dict:
    return {"class_path": "subprocess.Popen", "init_args": {"args": f"touch {marker}", "shell": True}}


def _assert_untouched(tmp_path: Path, before: dict, marker: Path) -> None:
    time.sleep(0.5)  # a shell started by the payload would have written its marker by now
    assert not marker.exists(), "the payload ran"
    assert snapshot(tmp_path) == before


def _fit(*args: str) -> None:
    cli_main(["fit", "--trainer.logger=false", "--trainer.accelerator=cpu", "--trainer.enable_checkpointing=false", *args])


@pytest.mark.parametrize("where", ["model_overrides", "nested", "class_path"])
def test_checkpoint_hyperparameters_build_nothing(tmp_path, where):
    """Library bug: jsonargparse instantiated the class_path of the Any-typed model_overrides (Popen ran)."""
    marker = tmp_path / "marker"
    hparams = {"learning_rate": 1e-3, "model_overrides": {"moe": _payload(marker)}}
    key = "model_overrides.moe.class_path"
    if where == "nested":
        hparams["model_overrides"] = {"moe": {"aux_loss_coeff": [_payload(marker)]}}
        key = r"model_overrides.moe.aux_loss_coeff\[0\].class_path"
    if where == "class_path":  # the class to build, named by the file
        hparams = {"_class_path": "subprocess.Popen", "args": f"touch {marker}", "shell": True}
        key = "_class_path"
    ckpt = tmp_path / "crafted.ckpt"
    torch.save({"hyper_parameters": hparams, "state_dict": {}}, ckpt)
    before = snapshot(tmp_path)
    pattern = rf"{re.escape(str(ckpt))}: hyper_parameters\.{key} .*refusing"
    with pytest.raises(ConfigError, match=pattern):
        _fit(f"--ckpt_path={ckpt}")
    _assert_untouched(tmp_path, before, marker)


def test_model_overrides_in_a_configuration_build_nothing(tmp_path, capsys):
    """Library bug: model_overrides (typed Any) instantiated a class_path from the YAML too; now the
    parser refuses a value its plain-data type does not hold (usage error, status 2)."""
    marker = tmp_path / "marker"
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  model_overrides:\n    moe:\n      class_path: subprocess.Popen\n"
                      f"      init_args: {{args: 'touch {marker}', shell: true}}\n")
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit, match="2"):
        _fit(f"--config={config}")
    assert 'Parser key "model_overrides"' in capsys.readouterr().err
    _assert_untouched(tmp_path, before, marker)


def test_plain_checkpoint_hyperparameters_still_configure_the_reference_model(tmp_path, monkeypatch):
    """The oracle: the hyperparameters MoELanguageModel saved, with another learning rate, reach the model built."""
    config = MoETransformerConfig(vocab_size=64, hidden_size=16, num_layers=1, num_attention_heads=2,
                                  max_seq_len=32, moe=MoEConfig(16, 8, 2, top_k=2))
    hparams = {**MoELanguageModel(config).hparams, "learning_rate": 0.25}
    ckpt = tmp_path / "plain.ckpt"
    torch.save({"hyper_parameters": hparams, "state_dict": {}}, ckpt)
    for i in range(2):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i}\n" * 20)
    monkeypatch.setattr(MoECLI, "_run_subcommand", lambda self, subcommand: None)  # build, do not train
    cli = cli_main(["fit", "--trainer.logger=false", "--trainer.accelerator=cpu", f"--data.source={tmp_path}",
                    "--data.seq_len=16", f"--ckpt_path={ckpt}"])
    assert cli.model.hparams == hparams
    assert cli.model.config == config


def test_reading_the_hyperparameters_does_not_read_the_weights(tmp_path):
    """Every rank parses ``--ckpt_path FILE`` (the launcher runs the command once per rank): the
    file is mapped, not read, so a consolidated checkpoint's weights never enter the ranks' memory
    here (the peak resident memory grows by far less than the 64 MiB tensor)."""
    checkpoint = tmp_path / "consolidated.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(16 << 20)}, "hyper_parameters": {"learning_rate": 0.5}}, checkpoint)
    found = {}
    growth = peak_rss_growth(lambda: found.update(checkpoint_hyperparameters(checkpoint, {"Model"})))
    assert growth < 16 << 20, f"the peak resident memory grew by {growth / 2**20:.1f} MiB reading the hyperparameters"
    assert checkpoint_hyperparameters(checkpoint, {"Model"}) == {"learning_rate": 0.5}
