"""`MoEStrategy` from the strategy registry (``strategy="moe"``) and from LightningCLI configurations."""

from __future__ import annotations

import sys
import textwrap
from unittest import mock

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from strategies.toy import ToyDataModule, ToyModule, quiet_trainer_kwargs
from torch.testing._internal.distributed.fake_pg import FakeStore

import lightning_moe.strategies
from lightning_moe.parallel import ParallelDims, build_parallel_context
from lightning_moe.strategies import MoEStrategy
from lightning_moe.strategies.sharding import make_grad_sync

YAML = textwrap.dedent(
    """\
    trainer:
      accelerator: cpu
      devices: 2
      logger: false
      enable_progress_bar: false
      enable_model_summary: false
      enable_checkpointing: false
      strategy:
        class_path: lightning_moe.strategies.MoEStrategy
        init_args:
          expert_parallel_size: 2
          dispatcher: allgather
    """
)


# LightningCLI's own use of jsonargparse APIs deprecated in jsonargparse 4.49 (not ours to fix).
pytestmark = pytest.mark.filterwarnings(r"ignore:(?s).*(deprecated in v4\.49\.0|JSONARGPARSE_DEPRECATION_WARNINGS)")


def _cli(args: list[str], run: bool = False) -> LightningCLI:
    # `args` replace the command line; hide pytest's own argv so LightningCLI does not warn about both.
    with mock.patch.object(sys, "argv", ["lightning-moe"]):
        return LightningCLI(
            ToyModule, ToyDataModule, run=run, args=args, save_config_callback=None, seed_everything_default=False
        )


def test_import_registers_moe():
    assert lightning_moe.strategies.MoEStrategy is MoEStrategy
    assert "moe" in StrategyRegistry
    assert StrategyRegistry["moe"]["strategy"] is MoEStrategy
    assert StrategyRegistry["moe"]["description"]


@pytest.mark.parametrize("devices", [1, 2])
def test_trainer_strategy_string_resolves_to_moe_strategy(devices):
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=devices, strategy="moe"))
    strategy = trainer.strategy
    assert type(strategy) is MoEStrategy
    assert strategy.num_processes == devices
    assert strategy.sizes == {"tp": 1, "cp": 1, "pp": 1, "ep": 1, "etp": None}
    assert strategy.dispatcher == "alltoall"
    assert strategy.is_distributed


def test_cli_yaml_class_path_and_init_args(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(YAML)
    cli = _cli(["--config", str(config)])
    strategy = cli.trainer.strategy
    assert type(strategy) is MoEStrategy
    assert strategy.sizes["ep"] == 2 and strategy.sizes["tp"] == 1 and strategy.sizes["etp"] is None
    assert strategy.dispatcher == "allgather"
    assert strategy.num_processes == 2


def test_cli_command_line_class_and_overrides():
    cli = _cli([
        "--trainer.accelerator=cpu", "--trainer.devices=4", "--trainer.logger=false",
        "--trainer.strategy=lightning_moe.strategies.MoEStrategy",
        "--trainer.strategy.expert_parallel_size=4", "--trainer.strategy.dispatcher=allgather",
        "--trainer.strategy.bucket_size_mb=1.5", "--trainer.strategy.grad_reduce_in_fp32=false",
    ])
    strategy = cli.trainer.strategy
    assert type(strategy) is MoEStrategy
    assert strategy.sizes["ep"] == 4 and strategy.dispatcher == "allgather" and strategy.bucket_size_mb == 1.5
    assert strategy.grad_reduce_in_fp32 is False and MoEStrategy().grad_reduce_in_fp32 is True


def test_grad_reduce_in_fp32_reaches_the_gradient_sync():
    """The strategy's option decides the dtype GradSync sums bf16 gradients in."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        ctx = build_parallel_context(ParallelDims(2), "cpu")
        model = torch.nn.Linear(4, 4).to(torch.bfloat16)
        for flag, want in ((True, torch.float32), (False, torch.bfloat16)):
            sync = make_grad_sync("NO_SHARD", model, ctx, 25.0, True, grad_reduce_in_fp32=flag)
            assert {bucket.reduce_dtype for bucket in sync.buckets} == {want}
            sync.remove_hooks()
    finally:
        dist.destroy_process_group()


def test_cli_yaml_override_from_command_line(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(YAML)
    cli = _cli(["--config", str(config), "--trainer.strategy.init_args.dispatcher=alltoall"])
    assert cli.trainer.strategy.dispatcher == "alltoall" and cli.trainer.strategy.sizes["ep"] == 2


def test_cli_registry_string():
    cli = _cli(["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false", "--trainer.strategy=moe"])
    assert type(cli.trainer.strategy) is MoEStrategy


def test_cli_bad_layout_fails_at_trainer_init(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(YAML.replace("devices: 2", "devices: 3"))
    with pytest.raises(ValueError, match=r"cannot fold 3 processes.*EP=2"):
        _cli(["--config", str(config)])


def _cli_fit(rank: int, world_size: int, config: str, root: str) -> dict:
    cli = _cli(["fit", "--config", config, "--trainer.max_steps=2", f"--trainer.default_root_dir={root}"], run=True)
    strategy = cli.trainer.strategy
    return {
        "type": type(strategy).__name__, "ep": strategy.parallel_context.size("ep"),
        "dispatcher": type(cli.model.net.moe1.dispatcher).__name__, "global_step": cli.trainer.global_step,
        "losses": cli.model.losses,
    }


@pytest.mark.distributed
def test_cli_fit_on_two_ranks(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(YAML)
    results = run_distributed(_cli_fit, 2, str(config), str(tmp_path), timeout_s=120, tmp_dir=tmp_path)
    for r in results:
        assert r["type"] == "MoEStrategy" and r["ep"] == 2 and r["global_step"] == 2
        assert "allgather" in r["dispatcher"].lower(), r["dispatcher"]
        assert len(r["losses"]) == 2
