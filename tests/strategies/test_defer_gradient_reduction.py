"""``MoEStrategy(defer_gradient_reduction=...)``: its default, how a YAML sets it, what it refuses.

What it does to the gradients (held shards or unsharded gradients between micro-batches, equal
results) is tested on gloo ranks: ``tests/parallel/test_sharded_grad_memory.py`` (no Lightning),
``test_sharding_parity.py`` and ``test_pipeline_sharding.py`` (through the strategy).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import pytest
import yaml

from lightning_moe.cli import cli_main
from lightning_moe.strategies import MoEStrategy

CONFIG = Path(__file__).resolve().parents[2] / "examples/configs/tiny_cpu.yaml"


def test_no_shard_refuses_deferral():
    with pytest.raises(ValueError, match=r"defer_gradient_reduction=True applies to the sharded strategies .*"
                                         r"sharding_strategy='NO_SHARD'"):
        MoEStrategy(defer_gradient_reduction=True)
    assert MoEStrategy(sharding_strategy="FULL_SHARD").defer_gradient_reduction is False  # the default
    assert MoEStrategy(sharding_strategy="SHARD_GRAD_OP", defer_gradient_reduction=True).defer_gradient_reduction


def test_a_yaml_sets_it(tmp_path):
    strategy = tmp_path / "strategy.yaml"
    strategy.write_text(yaml.safe_dump({"trainer": {"strategy": {
        "class_path": "lightning_moe.strategies.MoEStrategy",
        "init_args": {"expert_parallel_size": 4, "sharding_strategy": "FULL_SHARD", "defer_gradient_reduction": True},
    }}}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings(), pytest.raises(SystemExit) as exit_info:
        warnings.simplefilter("ignore")  # LightningCLI: args given while pytest has its own argv
        cli_main(["fit", "--config", str(CONFIG), "--config", str(strategy), "--print_config"])
    assert exit_info.value.code in (0, None)
    init_args = yaml.safe_load(out.getvalue())["trainer"]["strategy"]["init_args"]
    assert (init_args["sharding_strategy"], init_args["defer_gradient_reduction"]) == ("FULL_SHARD", True)

