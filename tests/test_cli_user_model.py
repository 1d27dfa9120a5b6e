"""``lightning-moe fit`` with a user's own model and data, named by ``class_path`` in a YAML.

The user project is ``tests/helpers/user_model.py`` copied into ``<tmp>/my_project/`` (a package
outside lightning_moe and the test tree): its own attention and LayerNorm, two
``lightning_moe.MoELayer`` blocks, a ``LightningDataModule`` of random tokens. The CLI trains it
on 2 forked gloo ranks at EP=2 (``MoEStrategy`` launches nothing: the process group exists).
After ``fit`` every rank runs the trained, expert-sharded model on one fixed input; then, in the
pytest process (no process group), ``lightning-moe export`` turns the run's sharded checkpoint
into one file that must load with ``strict=True`` into the single-device model, whose outputs on
that input must equal both ranks' (fp32 tolerance: the same arithmetic, a different order of
the expert sums).
"""

from __future__ import annotations

import math
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from helpers.asserts import assert_close_to_scale
from helpers.dist import run_distributed
from helpers.user_model import UserMoELM, write_user_project

from lightning_moe.checkpoint.export import export_checkpoint
from lightning_moe.cli import cli_main

HELPERS = Path(__file__).resolve().parent / "helpers"
WORLD = 2
STEPS = 4
MODEL_ARGS = {"vocab_size": 64, "hidden_size": 32, "num_heads": 4, "num_experts": 4, "top_k": 2}
USER_YAML = textwrap.dedent(
    f"""\
    seed_everything: 7
    trainer:
      accelerator: cpu
      devices: {WORLD}
      strategy:
        class_path: lightning_moe.strategies.MoEStrategy
        init_args:
          expert_parallel_size: {WORLD}
      max_epochs: 1
      limit_train_batches: {STEPS}
      limit_val_batches: 1
      num_sanity_val_steps: 0
      log_every_n_steps: 1
      enable_progress_bar: false
      enable_model_summary: false
      logger:
        class_path: lightning.pytorch.loggers.CSVLogger
        init_args:
          save_dir: logs
          name: user
      callbacks:
        - class_path: lightning_moe.callbacks.LoadBalanceMonitor
          init_args:
            log_every_n_steps: 1
        - class_path: lightning_moe.callbacks.CUDAGraphCapture
        - class_path: lightning_moe.callbacks.ActivationOffload
    model:
      class_path: my_project.user_model.UserMoELM
      init_args: {MODEL_ARGS}
    data:
      class_path: my_project.user_model.RandomTokenDataModule
      init_args:
        vocab_size: 64
        seq_len: 16
        batch_size: 4
        num_samples: 32
    """
)

# LightningCLI's own use of jsonargparse APIs deprecated in jsonargparse 4.49 (not ours to fix).
pytestmark = pytest.mark.filterwarnings(r"ignore:(?s).*(deprecated in v4\.49\.0|JSONARGPARSE_DEPRECATION_WARNINGS)")


def probe_tokens() -> torch.Tensor:
    """The fixed input every model is run on after training."""
    return torch.randint(0, MODEL_ARGS["vocab_size"], (3, 16), generator=torch.Generator().manual_seed(5))


def _fit_user_model(rank: int, world_size: int, root: str) -> dict:
    os.chdir(root)  # the YAML's relative save_dir lands in tmp_path
    sys.path.insert(0, root)  # the user's project is importable, as from its own folder
    cli = cli_main(["fit", "--config", str(Path(root) / "user.yaml")])
    model = cli.model.eval()
    with torch.no_grad():
        logits = model(probe_tokens())
    callback = cli.trainer.checkpoint_callback
    return {
        "class": f"{type(cli.model).__module__}.{type(cli.model).__qualname__}",
        "data_class": f"{type(cli.datamodule).__module__}.{type(cli.datamodule).__qualname__}",
        "global_step": cli.trainer.global_step,
        "local_experts": [block.moe.experts.num_experts for block in model.blocks],
        "train_loss": float(cli.trainer.callback_metrics["train_loss"]),
        "logits": logits,
        # Relative to the run's folder (the YAML's save_dir is): absolute for the pytest process.
        "checkpoint": os.path.abspath(callback.best_model_path),
        "log_dir": os.path.abspath(cli.trainer.logger.log_dir),
        "moe_metrics": sorted(k for k in cli.trainer.callback_metrics if k.startswith("moe/")),
    }


@pytest.fixture(scope="module")
def user_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cli_user_model")
    write_user_project(root, USER_YAML)
    ranks = run_distributed(_fit_user_model, WORLD, str(root), timeout_s=180, tmp_dir=root)
    return {"root": root, "ranks": ranks}


@pytest.mark.distributed
@pytest.mark.slow
def test_fit_trains_a_user_model_named_by_class_path(user_run):
    for rank, result in enumerate(user_run["ranks"]):
        assert result["class"] == "my_project.user_model.UserMoELM", rank
        assert result["data_class"] == "my_project.user_model.RandomTokenDataModule", rank
        assert result["global_step"] == STEPS, rank
        assert result["local_experts"] == [MODEL_ARGS["num_experts"] // WORLD] * 2, rank  # EP=2 sharded them
        assert math.isfinite(result["train_loss"]), rank
        # The defaults of LoadBalanceMonitor, CUDAGraphCapture and ActivationOffload on a model that is
        # not the reference one: monitored per layer, graphs and offload warn on CPU and stand aside.
        assert {"moe/layer_0/imbalance", "moe/layer_1/imbalance"} <= set(result["moe_metrics"]), result["moe_metrics"]
    # SaveConfigCallback records the class paths, so the saved config reruns the same project.
    saved = yaml.safe_load((Path(user_run["ranks"][0]["log_dir"]) / "config.yaml").read_text())
    assert saved["model"]["class_path"] == "my_project.user_model.UserMoELM"
    assert saved["data"]["class_path"] == "my_project.user_model.RandomTokenDataModule"


@pytest.mark.distributed
@pytest.mark.slow
def test_export_of_user_model_loads_strictly_with_the_trained_outputs(user_run, tmp_path):
    checkpoint = Path(user_run["ranks"][0]["checkpoint"])
    assert checkpoint.is_dir() and (checkpoint / "meta.pt").is_file(), checkpoint  # sharded
    out = tmp_path / "user_model.pt"
    summary = export_checkpoint(checkpoint, out)
    assert summary.output == out and out.is_file()

    state = torch.load(out, weights_only=True, map_location="cpu")
    model = UserMoELM(**MODEL_ARGS)  # the single-device model, fresh weights
    assert sorted(state) == sorted(model.state_dict())
    model.load_state_dict(state, strict=True)
    assert state["blocks.0.moe.experts.fc1_weight"].shape[0] == MODEL_ARGS["num_experts"]  # global, all experts
    with torch.no_grad():
        logits = model.eval()(probe_tokens())
    for rank, result in enumerate(user_run["ranks"]):
        torch.testing.assert_close(logits, result["logits"], msg=lambda m, r=rank: f"rank {r}: {m}")


def _fit_with_the_trainer(rank: int, world_size: int, ep: int) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from strategies.toy import full_tensors

    from lightning_moe.callbacks import ActivationOffload, CUDAGraphCapture, LoadBalanceMonitor
    from lightning_moe.strategies import MoEStrategy

    sys.path.insert(0, str(HELPERS.parent))
    from helpers.user_model import RandomTokenDataModule

    class Grads(Callback):
        """The reduced gradients of every step, as global tensors (expert shards gathered)."""

        def __init__(self) -> None:
            self.steps: list[dict] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.steps.append(full_tensors(pl_module, {n: p.grad for n, p in pl_module.named_parameters()}))

    torch.manual_seed(7)
    model, grads = UserMoELM(**MODEL_ARGS), Grads()
    callbacks = [LoadBalanceMonitor(log_every_n_steps=1), CUDAGraphCapture(), ActivationOffload(), grads]
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=MoEStrategy(expert_parallel_size=ep), max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=callbacks,
    )
    trainer.fit(model, RandomTokenDataModule(vocab_size=64, seq_len=16, batch_size=4, num_samples=32))
    return {"grads": grads.steps, "moe_metrics": [k for k in trainer.callback_metrics if k.startswith("moe/")]}


@pytest.mark.distributed
def test_trainer_fit_of_a_user_model_at_ep2_equals_replicated_experts(tmp_path):
    """The same user model, data and callbacks at EP=2 and at EP=1 (experts replicated on both
    ranks): every gradient of every step equal. (Weights are not compared: AdamW turns gradient
    entries near zero into full-size steps of either sign, so rounding decides them.)"""
    sharded = run_distributed(_fit_with_the_trainer, WORLD, 2, timeout_s=180, tmp_dir=tmp_path)
    replicated = run_distributed(_fit_with_the_trainer, WORLD, 1, timeout_s=180, tmp_dir=tmp_path)
    for got, want in zip(sharded, replicated):
        assert got["moe_metrics"] and len(got["grads"]) == len(want["grads"]) == STEPS
        for step, (mine, theirs) in enumerate(zip(got["grads"], want["grads"])):
            assert mine.keys() == theirs.keys()
            for key, value in theirs.items():
                assert_close_to_scale(mine[key], value, 1e-4, f"step {step} gradient of {key}")
