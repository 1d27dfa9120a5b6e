"""``examples/train_torchrun.py``: the core library trained by a plain torchrun script (no Lightning).

The script runs under ``python -m torch.distributed.run --standalone`` on 2 CPU processes, from an
empty working directory elsewhere (it must neither depend on nor write to the working directory),
for a few steps; rank 0's loss lines must be finite and the sharded checkpoint it writes must load
into the one-device model with global keys and shapes. Argument errors are checked in-process.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.dist import run_distributed

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.parallel import (
    ParallelDims,
    apply_expert_parallel,
    build_parallel_context,
    is_expert_param,
)
from lightning_moe.parallel.grad_sync import reduce_group_name

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_torchrun.py"
NPROC = 2
STEPS = 5
# Two torch imports, the rendezvous and 5 steps take ~7 s here; generous for a loaded 2-core machine.
TORCHRUN_TIMEOUT_S = 120
LOSS_LINE = re.compile(r"^step\s+(\d+)/(\d+)\s+loss (\S+)", re.MULTILINE)


def _load_script():
    spec = importlib.util.spec_from_file_location("train_torchrun", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torchrun(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """Run the script under torchrun; on timeout kill the whole process group (agent and workers)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
        str(SCRIPT), *args,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    with subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=TORCHRUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"torchrun did not finish in {TORCHRUN_TIMEOUT_S} s:\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize(
    "layout",
    [
        ["--tp", "1", "--ep", "2"],
        ["--tp", "2", "--etp", "1", "--ep", "2", "--dispatcher", "allgather"],  # folded: TP2 x EP2 on 2 ranks
    ],
    ids=["tp1-ep2-alltoall", "tp2-etp1-ep2-allgather"],
)
def test_torchrun_script_trains_and_saves(tmp_path, layout):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    ckpt = tmp_path / "ckpt"
    result = _torchrun(
        cwd, *layout, "--steps", str(STEPS), "--log-every", "1", "--max-tokens", "50000", "--save", str(ckpt)
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    lines = LOSS_LINE.findall(result.stdout)
    assert [int(step) for step, _, _ in lines] == list(range(1, STEPS + 1)), result.stdout  # rank 0 only
    assert all(int(total) == STEPS for _, total, _ in lines)
    losses = [float(loss) for _, _, loss in lines]
    assert all(math.isfinite(loss) for loss in losses), losses
    assert list(cwd.iterdir()) == []

    # The checkpoint has global keys and shapes: it loads into the one-device model.
    script = _load_script()
    torch.manual_seed(0)
    model = script.MoETransformer(script.model_config(64))
    state = model.state_dict()
    before = {k: v.clone() for k, v in state.items()}
    dcp.load(state, checkpoint_id=ckpt)
    assert all(not torch.equal(state[k], before[k]) for k in state), [k for k in state if torch.equal(state[k], before[k])]
    assert state["layers.0.ffn.experts.fc1_weight"].shape == (8, 2, 64, 64)  # gated: (E, 2, F, H)


def test_script_refuses_to_run_without_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match="Launch with torchrun"):
        _load_script().main(["--steps", "1"])


@pytest.mark.parametrize("flag", ["--steps", "--batch", "--log-every"])
def test_script_rejects_non_positive_sizes(flag, capsys):
    with pytest.raises(SystemExit) as info:
        _load_script().parse_args([flag, "0"])
    assert info.value.code == 2
    assert f"{flag} must be >= 1" in capsys.readouterr().err


# -- library bug found while writing the example ------------------------------------------------


def _meta_init_keeps_expert_tags(rank: int, world_size: int) -> dict:
    ctx = build_parallel_context(ParallelDims(world_size, ep=world_size), "cpu")
    torch.manual_seed(0)
    with torch.device("meta"):
        layer = MoELayer(MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2))
    apply_expert_parallel(layer, ctx)
    tagged_on_meta = is_expert_param(layer.experts.fc1_weight)
    layer.to_empty(device="cpu")  # the documented materialisation: to_empty, then reset_parameters
    layer.reset_parameters()
    weight = layer.experts.fc1_weight
    return {
        "tagged_on_meta": tagged_on_meta,
        "tagged_after_to_empty": is_expert_param(weight),
        "grad_group": reduce_group_name(weight),
        "state_dict_shape": tuple(layer.state_dict()["experts.fc1_weight"].shape),
    }


@pytest.mark.distributed
def test_expert_shards_stay_tagged_after_meta_materialisation(tmp_path):
    """Library bug (``lightning_moe/parallel/expert_parallel.py``, ``_shard_experts``): the
    expert-shard tag is an attribute on the ``nn.Parameter`` object, and ``Module.to_empty`` on a
    meta-device module replaces every parameter with a new object (meta and CPU tensors are not
    shallow-copy compatible), dropping the tag. ``apply_expert_parallel``'s docstring documents
    exactly this order (meta build, shard, ``to_empty``, ``reset_parameters``), and so does
    ``MoEStrategy`` (``Trainer.init_module(empty_init=True)`` -> ``model_setup.materialize``). Untagged expert
    shards are then treated as dense parameters: ``GradSync`` sums different experts' gradients
    over ``tp_dp_cp`` instead of ``edp``, the global grad norm counts them as replicated, and
    ``state_dict()`` returns local shards (a checkpoint of ``[E/EP, ...]`` tensors)."""
    results = run_distributed(_meta_init_keeps_expert_tags, 2, tmp_dir=tmp_path, timeout_s=60)
    for rank, result in enumerate(results):
        assert result["tagged_on_meta"], rank
        assert result == {
            "tagged_on_meta": True, "tagged_after_to_empty": True, "grad_group": "edp", "state_dict_shape": (4, 2, 4, 8),
        }, (rank, result)


# -- examples/configs/hf_finetune_tiny.yaml ------------------------------------------------------

HF_CONFIG = REPO / "examples" / "configs" / "hf_finetune_tiny.yaml"


def _finetune(rank: int, world_size: int, root: str, model_dir: str) -> dict:
    from lightning_moe.cli import cli_main

    os.chdir(root)
    cli = cli_main([
        "fit", "--config", str(HF_CONFIG), f"--trainer.devices={world_size}",
        "--trainer.strategy.init_args.expert_parallel_size=2", "--trainer.max_steps=2",
        "--trainer.limit_val_batches=1", "--trainer.val_check_interval=2", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--data.max_tokens=20000", f"--model.init_from={model_dir}",
        f"--data.tokenizer={model_dir}", f"--trainer.logger.init_args.save_dir={root}/logs",
    ])
    return {"global_step": cli.trainer.global_step, "loss": float(cli.trainer.callback_metrics["train_loss"]),
            "checkpoint": cli.trainer.checkpoint_callback.last_model_path, "vocab": cli.datamodule.vocab_size}


@pytest.mark.distributed
@pytest.mark.slow
def test_hf_finetune_config_trains_and_exports(tmp_path):
    """The fine-tuning example on 2 ranks (TP=2 x EP=2 folded), from the tiny directory that
    ``examples/make_tiny_hf_model.py`` writes, 2 steps; its checkpoint exports with ``--format hf``
    and loads in ``transformers``."""
    transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
    pytest.importorskip("tokenizers", reason="the hf and test extras install tokenizers")
    spec = importlib.util.spec_from_file_location("make_tiny_hf_model", REPO / "examples" / "make_tiny_hf_model.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    model_dir = tmp_path / "tiny_qwen3_moe"
    maker.main([str(model_dir)])
    results = run_distributed(_finetune, 2, str(tmp_path), str(model_dir), tmp_dir=tmp_path, timeout_s=240)
    assert all(r["global_step"] == 2 and math.isfinite(r["loss"]) for r in results), results
    assert results[0]["vocab"] == maker.VOCAB_SIZE
    from lightning_moe.cli import cli_main

    cli_main(["export", results[0]["checkpoint"], str(tmp_path / "tuned"), "--format", "hf"])
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tuned")
    assert type(tuned).__name__ == "Qwen3MoeForCausalLM"
