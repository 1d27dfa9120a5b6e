"""Tests of the step-memory meter ``helpers.step_memory`` against counts made from the config alone.

Two shortened fits of ``examples/configs/tiny_cpu.yaml`` (fp32, AdamW, ``GradSync`` buckets):

* world 1 (TP = EP = 1): the rank holds the whole model. Oracle: ``P`` parameter elements
  (`scale.formula.global_parameters`, from the config fields) and ``T`` parameter tensors (a
  meta-device ``MoETransformer``); then parameters are ``4 P`` bytes, gradients ``4 (P + T)``
  (``GradSync``'s buckets, whose storages the gradients are views of, end with one fp32 flag per
  parameter), AdamW's states ``2 x 4 P + 4 T`` (``exp_avg``, ``exp_avg_sq``, and ``step``, a 0-d
  fp32 tensor per parameter), and the peak holds at least all three plus some activations;
* world 4 as configured (TP=2, EP=4): each rank's parameters are ``4 x`` its share by the
  layout's arithmetic (`scale.formula.local_parameters`), with the same relations for gradients
  and optimizer states.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from helpers.step_memory import MEASURED_KEYS, measure_fit
from scale.formula import global_parameters, local_parameters

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims

pytestmark = pytest.mark.distributed

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny_cpu.yaml"
FP32 = 4
ADAM_MOMENTS = 2
# Enough byte tokens for the few batches of two optimizer steps; the default 600k take longer to read.
SHORT_DATA = "--data.max_tokens=60000"
STRATEGY = "--trainer.strategy.init_args."


def _config() -> MoETransformerConfig:
    fields = yaml.safe_load(CONFIG.read_text())["model"]["model"]
    return MoETransformerConfig(**{**fields, "moe": MoEConfig(**fields["moe"])})


def _parameter_tensors(config: MoETransformerConfig) -> int:
    with torch.device("meta"):
        return len(list(MoETransformer(config).parameters()))


def _check_relations(measured: dict, elements: int, tensors: int) -> None:
    assert set(measured) == set(MEASURED_KEYS)
    assert all(isinstance(v, int) for v in measured.values()), measured
    assert measured["params_bytes"] == FP32 * elements
    assert measured["grads_bytes"] == FP32 * (elements + tensors)
    assert measured["optimizer_bytes"] == ADAM_MOMENTS * FP32 * elements + FP32 * tensors
    held = measured["params_bytes"] + measured["grads_bytes"] + measured["optimizer_bytes"]
    assert measured["activation_bytes"] == measured["peak_bytes"] - held
    assert measured["activation_bytes"] > 0, measured  # the forward's activations exist at the peak


def test_one_rank_holds_the_whole_model_state():
    config = _config()
    (measured,) = measure_fit(
        ["--config", str(CONFIG), SHORT_DATA, f"{STRATEGY}tensor_parallel_size=1", f"{STRATEGY}expert_parallel_size=1"],
        world_size=1, timeout_s=120,
    )
    _check_relations(measured, global_parameters(config), _parameter_tensors(config))


def test_each_rank_holds_its_layout_share():
    config = _config()
    dims = ParallelDims(world_size=4, tp=2, ep=4, etp=1)  # the config's strategy
    ranks = measure_fit(["fit", "--config", str(CONFIG), SHORT_DATA], world_size=4, timeout_s=120)
    assert len(ranks) == dims.world_size
    for measured in ranks:
        _check_relations(measured, local_parameters(config, dims), _parameter_tensors(config))
