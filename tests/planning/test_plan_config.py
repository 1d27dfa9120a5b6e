"""`configuration_parsed_once`: the planning runs of one plan parse its configuration once, and
each run still gets its own step count and folder, and a configuration edited after the plan is
read again."""

from __future__ import annotations

import shutil
from pathlib import Path
from unittest import mock

from lightning.pytorch.cli import LightningCLI

from lightning_moe.planning.plan_config import callers_state_kept, configuration_parsed_once, plan_cli

TINY = Path(__file__).parents[2] / "examples" / "configs" / "tiny_cpu.yaml"


def _built(config: Path, measure_step: int, root: Path):
    with callers_state_kept():
        cli = plan_cli(["--config", str(config)], measure_step, str(root))
    return cli.trainer, cli.model


def test_one_parse_serves_every_run_with_its_own_steps_and_folder(tmp_path):
    config = tmp_path / "tiny.yaml"
    shutil.copy(TINY, config)
    parses = mock.Mock(wraps=LightningCLI.parse_arguments)
    with mock.patch.object(LightningCLI, "parse_arguments", lambda self, *a: parses(self, *a)):
        with configuration_parsed_once():
            first_trainer, first_model = _built(config, 1, tmp_path / "a")
            second_trainer, second_model = _built(config, 3, tmp_path / "b")
        assert parses.call_count == 1
        assert (first_trainer.max_steps, second_trainer.max_steps) == (2, 4)
        assert (first_trainer.default_root_dir, second_trainer.default_root_dir) == (str(tmp_path / "a"),
                                                                                     str(tmp_path / "b"))
        assert first_model.hparams == second_model.hparams
        assert first_trainer.accumulate_grad_batches == second_trainer.accumulate_grad_batches

        # After the plan, an edited configuration is parsed again.
        config.write_text(TINY.read_text().replace("  accelerator: cpu", "  accelerator: cpu\n  accumulate_grad_batches: 3"))
        edited_trainer, _ = _built(config, 1, tmp_path / "c")
        assert parses.call_count == 2 and edited_trainer.accumulate_grad_batches == 3
