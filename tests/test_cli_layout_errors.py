"""Model-dependent layout errors come from ``lightning-moe fit`` once, before any rank starts.

Each case runs the CLI as a user does (``python -m lightning_moe.cli fit ...`` in a subprocess,
``trainer.devices=2`` on the CPU, no process group): Lightning's launcher would re-run the command
once per extra rank and every rank would set up its process group before parallelizing the model.
The CLI knows the model and the layout before that, so the error must appear exactly once in the
whole output, no rank may have initialised a process group (Lightning logs
``Initializing distributed`` for each), and nothing may be written (no logs, no checkpoints).

Cases: num_experts not divisible by EP; num_kv_heads not divisible by TP (reference model); a batch
that does not split into the pipeline's micro-batches (a configuration check of
:mod:`lightning_moe.cli_checks`, whose other checks are tested in-process in
``test_cli_config_checks.py``).

In-process unit tests of :mod:`lightning_moe.parallel.layout.check` follow: the check accepts the
layouts the suite trains with, reports each problem, and its meta-device copy leaves the model and
the RNG that will initialise it untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers.user_model import UserMoELM

from lightning_moe import MoEConfig
from lightning_moe.cli import check_layout_before_launch
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models import MoETransformerConfig
from lightning_moe.parallel import ParallelDims
from lightning_moe.parallel.layout.check import LayoutError, check_model_layout, layout_problems, meta_copy
from lightning_moe.strategies import MoEStrategy

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "configs" / "tiny_cpu.yaml"
# One torch + lightning import (~5 s here); without the early check the ranks would start, build
# their process groups and fail in setup, which takes longer, but this is a hang guard, not a timing.
SUBPROCESS_TIMEOUT_S = 180
STARTED_RANK = "Initializing distributed"
"""What Lightning logs when a rank sets up its process group."""

TWO_RANKS = ["--trainer.devices=2", "--trainer.logger.init_args.save_dir=logs"]
CASES = {
    "experts-vs-ep": (
        [*TWO_RANKS, "--trainer.strategy.init_args.tensor_parallel_size=1",
         "--trainer.strategy.init_args.expert_parallel_size=2", "--model.model.moe.num_experts=3"],
        "num_experts=3 is not divisible by ep=2",
    ),
    "kv-heads-vs-tp": (
        [*TWO_RANKS, "--trainer.strategy.init_args.expert_parallel_size=2", "--model.model.num_kv_heads=1"],
        "Tensor parallel size 2 must divide num_kv_heads=1",
    ),
    "batch-vs-microbatches": (
        [*TWO_RANKS, "--trainer.strategy.init_args.tensor_parallel_size=1",
         "--trainer.strategy.init_args.expert_parallel_size=1", "--trainer.strategy.init_args.pipeline_parallel_size=2",
         "--trainer.strategy.init_args.num_microbatches=3"],
        "data.batch_size=8 does not split into num_microbatches=3 equal micro-batches",
    ),
}


def _run_fit(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(cwd), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # start_new_session: a timeout kills the CLI and any rank it launched.
    with subprocess.Popen(
        [sys.executable, "-m", "lightning_moe.cli", "fit", *args], cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=SUBPROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            stdout, stderr = process.communicate()
            pytest.fail(f"lightning-moe fit did not finish in {SUBPROCESS_TIMEOUT_S} s:\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _assert_one_early_error(result: subprocess.CompletedProcess, message: str, cwd: Path, inputs: set[str]) -> None:
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert output.count(message) == 1, f"expected {message!r} once:\n{output}"
    assert STARTED_RANK not in output, f"a rank started before the error:\n{output}"
    assert {p.name for p in cwd.iterdir()} == inputs, sorted(p.name for p in cwd.iterdir())  # nothing written


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_model_layout_error_before_any_rank_starts(case, tmp_path):
    args, message = CASES[case]
    result = _run_fit(tmp_path, "--config", str(CONFIG), *args)
    _assert_one_early_error(result, message, tmp_path, set())


# ---------------------------------------------------------------------------------------- layout_check


def _reference(**overrides) -> MoELanguageModel:
    fields = yaml.safe_load(CONFIG.read_text())["model"]["model"]
    moe = {**fields["moe"], **overrides.pop("moe", {})}
    return MoELanguageModel(MoETransformerConfig(**{**fields, **overrides, "moe": MoEConfig(**moe)}))


def test_meta_copy_builds_configure_model_layers_without_touching_the_model_or_the_rng():
    model = _reference()  # the reference model builds its transformer in configure_model
    assert model.model is None
    torch.manual_seed(11)
    probe = meta_copy(model)
    after_probe = torch.rand(4)
    torch.manual_seed(11)
    expected = torch.rand(4)
    torch.testing.assert_close(after_probe, expected, rtol=0, atol=0)  # the MoELayer seed draws were undone
    assert model.model is None  # the original is not configured
    assert probe.model is not None and all(p.is_meta for p in probe.parameters())

    user = UserMoELM()
    before = {k: v.clone() for k, v in user.state_dict().items()}
    copy = meta_copy(user)
    assert all(p.is_meta for p in copy.parameters()) and not any(p.is_meta for p in user.parameters())
    for key, value in user.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=key)


def test_layouts_the_suite_trains_with_pass():
    check_model_layout(meta_copy(_reference()), ParallelDims(4, tp=2, ep=4, etp=1))  # tiny_cpu.yaml
    check_model_layout(meta_copy(_reference()), ParallelDims(2, tp=2, ep=2, etp=1))
    check_model_layout(meta_copy(UserMoELM()), ParallelDims(2, ep=2))
    # A user model at TP > 1: each TP rank routes its slice of the MoE layers' input (user_tensor_parallel).
    check_model_layout(meta_copy(UserMoELM()), ParallelDims(2, tp=2, ep=2, etp=1))


def test_fc2_bias_passes_at_every_expert_tensor_parallel_size():
    model = meta_copy(_reference(moe={"fc2_bias": True}))
    for etp in (1, 2, 4):
        check_model_layout(model, ParallelDims(4, ep=4 // etp, etp=etp))


def test_every_problem_is_reported_once():
    model = meta_copy(_reference(num_kv_heads=1, moe={"num_experts": 6, "ffn_hidden_size": 63, "fc2_bias": True}))
    dims = ParallelDims(8, tp=2, ep=4, etp=2)
    problems = layout_problems(model, dims)
    # fc2_bias is no problem at ETP=2 (one ETP rank adds it): three problems, none about the bias.
    assert len(problems) == 3, problems  # two MoE layers, each problem once
    assert problems[0].startswith("num_experts=6 is not divisible by ep=4")
    assert problems[1].startswith("ffn_hidden_size=63 is not divisible by the expert tensor parallel size 2")
    assert problems[2].startswith("Tensor parallel size 2 must divide num_kv_heads=1")
    with pytest.raises(LayoutError, match=r"(?s)cannot be sharded on world 8: .*\n  - num_experts=6.*\n  - ffn_hidden"):
        check_model_layout(model, dims)


class _NeedsTrainer(UserMoELM):
    def configure_model(self) -> None:
        _ = self.trainer.world_size  # raises: not attached to a Trainer yet


def test_a_model_that_cannot_be_copied_is_left_to_the_per_rank_checks():
    strategy = MoEStrategy(expert_parallel_size=2, parallel_devices=[torch.device("cpu")] * 2)
    check_layout_before_launch(_NeedsTrainer(num_experts=3), strategy)  # no error now; setup checks it
    with pytest.raises(LayoutError, match="num_experts=3 is not divisible by ep=2"):
        check_layout_before_launch(UserMoELM(num_experts=3), strategy)
