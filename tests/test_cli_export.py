"""``lightning-moe export CKPT OUT``: a checkpoint of any layout to one ``torch.save`` file of weights.

Oracle: the single-device reference model, built here from ``tiny_cpu.yaml``'s model section (no
CLI, no strategy), loaded with ``load_state_dict(strict=True)`` from the exported file (read with
``torch.load(weights_only=True)``), must give the same logits on a fixed input as the model the
CLI trained on 2 forked gloo ranks (fp32 tolerance), at two layouts:

* ``ep2``: TP=1, EP=2 (dense DP=2): expert tensors sharded over EP in the checkpoint;
* ``tp2``: TP=2, ETP=1, EP=2 folded on the same 2 ranks: attention and embeddings sharded over TP too.

The export runs in the pytest process, without a process group. The error cases (missing or
foreign paths, an existing output, altered or truncated shards, a failing write) use copies of
the ``ep2`` checkpoint or small synthetic ones; the command line is checked in-process through
:func:`lightning_moe.cli.cli_main` and, for the top-level ``--help``, through the console script.
"""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from helpers.console import console_script
from helpers.dist import run_distributed
from torch import nn

from lightning_moe import MoEConfig
from lightning_moe.checkpoint.export import export_checkpoint
from lightning_moe.checkpoint.integrity import CheckpointIntegrityError
from lightning_moe.cli import cli_main
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models import MoETransformerConfig

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "configs" / "tiny_cpu.yaml"
WORLD = 2
LAYOUTS = {
    "ep2": ["--trainer.strategy.init_args.tensor_parallel_size=1", "--trainer.strategy.init_args.expert_parallel_size=2"],
    "tp2": [
        "--trainer.strategy.init_args.tensor_parallel_size=2", "--trainer.strategy.init_args.expert_tensor_parallel_size=1",
        "--trainer.strategy.init_args.expert_parallel_size=2",
    ],
}
SHORT_RUN = [
    f"--trainer.devices={WORLD}", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
    "--trainer.limit_val_batches=1", "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false", "--data.max_tokens=60000",
]
SUBPROCESS_TIMEOUT_S = 120  # one torch + lightning import, ~5 s here

# LightningCLI's own use of jsonargparse APIs deprecated in jsonargparse 4.49 (not ours to fix).
pytestmark = pytest.mark.filterwarnings(r"ignore:(?s).*(deprecated in v4\.49\.0|JSONARGPARSE_DEPRECATION_WARNINGS)")


def reference_model() -> MoELanguageModel:
    """The single-device reference model of ``tiny_cpu.yaml``, built without the CLI."""
    fields = yaml.safe_load(CONFIG.read_text())["model"]["model"]
    config = MoETransformerConfig(**{**fields, "moe": MoEConfig(**fields["moe"])})
    model = MoELanguageModel(config)
    model.configure_model()
    return model


def probe_tokens() -> torch.Tensor:
    """A fixed input of byte tokens; 64 positions divide by TP=2."""
    return torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(3))


def _fit(rank: int, world_size: int, root: str, layout: list[str]) -> dict:
    os.chdir(root)
    cli = cli_main(["fit", "--config", str(CONFIG), *SHORT_RUN, *layout, f"--trainer.logger.init_args.save_dir={root}/logs"])
    with torch.no_grad():
        logits = cli.model.eval()(probe_tokens())
    return {"logits": logits, "checkpoint": cli.trainer.checkpoint_callback.last_model_path,
            "global_step": cli.trainer.global_step}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(layout)``: the CLI's 2-rank training at ``layout``, run once per module and layout."""
    done: dict[str, dict] = {}

    def run(layout: str) -> dict:
        if layout not in done:
            root = tmp_path_factory.mktemp(f"export_{layout}")
            ranks = run_distributed(_fit, WORLD, str(root), LAYOUTS[layout], timeout_s=180, tmp_dir=root)
            done[layout] = {"layout": layout, "ranks": ranks, "checkpoint": Path(ranks[0]["checkpoint"])}
        return done[layout]

    return run


@pytest.fixture(params=sorted(LAYOUTS))
def trained(request, runs) -> dict:
    return runs(request.param)


@pytest.fixture
def ep2_checkpoint(runs) -> Path:
    return runs("ep2")["checkpoint"]


# ---------------------------------------------------------------------------------------- round trip


@pytest.mark.distributed
@pytest.mark.slow
def test_export_loads_strictly_into_the_single_device_model_with_equal_outputs(trained, tmp_path):
    checkpoint = trained["checkpoint"]
    assert checkpoint.is_dir() and (checkpoint / "meta.pt").is_file() and any(checkpoint.glob("*.distcp"))
    assert all(r["global_step"] == 2 for r in trained["ranks"])
    out = tmp_path / "weights.pt"
    summary = export_checkpoint(checkpoint, out)
    assert summary.kind == "sharded" and summary.verified and summary.output == out
    assert summary.layout["world_size"] == WORLD
    assert summary.layout["tp"] == (2 if trained["layout"] == "tp2" else 1) and summary.layout["ep"] == 2

    state = torch.load(out, weights_only=True, map_location="cpu")
    model = reference_model()
    assert sorted(state) == sorted(model.state_dict())  # the model's keys, nothing else (no optimizer)
    assert all(type(v) is torch.Tensor for v in state.values())  # plain global tensors, no DTensor
    assert state["model.layers.0.ffn.experts.fc1_weight"].shape == (8, 2, 64, 64)  # gated: (E, 2, F, H)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model.eval()(probe_tokens())
    for rank, result in enumerate(trained["ranks"]):
        torch.testing.assert_close(logits, result["logits"], msg=lambda m, r=rank: f"{trained['layout']} rank {r}: {m}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.pt"]  # no temporary file left


@pytest.mark.distributed
@pytest.mark.slow
def test_generate_from_a_sharded_checkpoint_equals_an_argmax_loop_over_the_exported_model(trained, tmp_path, capsys):
    # lightning-moe generate reads the sharded checkpoint of either layout by itself; the oracle is the
    # single-device model loaded from the export (equal to the trained ranks' model, test above).
    from lightning_moe.data import ByteTokenizer

    export_checkpoint(trained["checkpoint"], tmp_path / "weights.pt")
    model = reference_model()
    model.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True), strict=True)
    prompt = ByteTokenizer().encode("def main(")
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(4):  # the hand-rolled argmax loop
            ids.append(int(model.eval()(torch.tensor([ids]))[0, -1].argmax()))
    expected = ids[len(prompt):]
    generated = cli_main(["generate", str(trained["checkpoint"]), "--prompt", "def main(", "--max_new_tokens", "4",
                          "--ignore_eos"])
    assert generated.new_ids == expected
    assert capsys.readouterr().out.endswith(generated.text + "\n")


@pytest.mark.distributed
@pytest.mark.slow
def test_export_format_hf_loads_in_transformers_with_equal_logits(trained, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
    out = tmp_path / "hf"
    # ~1 MiB of weights in shards of at most 256 KB, listed by the index, as transformers writes them.
    summary = cli_main(["export", str(trained["checkpoint"]), str(out), "--format", "hf", "--max-shard-size", "256KB"])
    assert summary.kind == "sharded" and summary.verified and summary.output == out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards == sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert (out / "config.json").is_file() and not (out / "model.safetensors").exists()
    # tiny_cpu.yaml's model (no q/k norm, softmax top-k) can only be Mixtral.
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf_model).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        logits = hf_model(input_ids=probe_tokens()).logits
    for rank, result in enumerate(trained["ranks"]):
        expected = result["logits"]
        torch.testing.assert_close(logits, expected, rtol=0.0, atol=1e-5 * expected.abs().max().item(),
                                   msg=lambda m, r=rank: f"{trained['layout']} rank {r}: {m}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary directory left
    with pytest.raises(SystemExit):  # a non-empty directory needs --overwrite
        cli_main(["export", str(trained["checkpoint"]), str(out), "--format", "hf"])
    cli_main(["export", str(trained["checkpoint"]), str(out), "--format", "hf", "--overwrite"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_export_format_hf_refuses_a_checkpoint_without_a_model_config(tmp_path, capsys):
    checkpoint = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"model.embed.weight": torch.zeros(4, 2)}, "hyper_parameters": {"lr": 1.0}}, checkpoint)
    with pytest.raises(SystemExit) as info:
        cli_main(["export", str(checkpoint), str(tmp_path / "hf"), "--format", "hf"])
    assert info.value.code == 1
    assert "records no MoETransformer configuration" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_export_of_a_consolidated_file_keeps_only_the_model_state(tmp_path):
    model = reference_model()
    checkpoint = tmp_path / "consolidated.ckpt"
    # What MoEStrategy(save_distributed_checkpoint=False) and single-device Lightning write.
    torch.save({"state_dict": model.state_dict(), "epoch": 3, "global_step": 7, "optimizer_states": [],
                "hyper_parameters": {"learning_rate": 0.003}}, checkpoint)
    summary = export_checkpoint(checkpoint, tmp_path / "out.pt")
    assert summary.kind == "consolidated"
    state = torch.load(tmp_path / "out.pt", weights_only=True)
    assert sorted(state) == sorted(model.state_dict())
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)


class _WithExtraState(nn.Module):
    """A module whose state dict holds a non-tensor (``get_extra_state``), saved by DCP as bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.extra = {"scale": 0.5, "history": [1, 2]}

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state) -> None:
        self.extra = state


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # dcp.save in one process
def test_export_of_a_sharded_checkpoint_with_nested_and_bytes_items(tmp_path):
    source = _WithExtraState()
    source.extra = {"scale": 2.0, "history": [3, 4, 5]}
    checkpoint = tmp_path / "ckpt"
    dcp.save({"state_dict": source.state_dict(), "optimizer_0": {"linear.weight": {"exp_avg": torch.ones(2, 3)}}},
             checkpoint_id=checkpoint, no_dist=True)
    torch.save({"epoch": 0, "lightning_moe": {"layout": {"world_size": 1}}}, checkpoint / "meta.pt")
    with pytest.warns(UserWarning, match="no checksums"):
        summary = export_checkpoint(checkpoint, tmp_path / "out.pt")
    assert not summary.verified
    state = torch.load(tmp_path / "out.pt", weights_only=True)
    target = _WithExtraState()
    target.load_state_dict(state, strict=True)
    assert target.extra == {"scale": 2.0, "history": [3, 4, 5]}
    torch.testing.assert_close(target.linear.weight, source.linear.weight, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------- errors


def test_missing_checkpoint_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing.ckpt does not exist"):
        export_checkpoint(tmp_path / "nothing.ckpt", tmp_path / "out.pt")
    assert list(tmp_path.iterdir()) == []


def test_folder_that_is_not_a_checkpoint_is_refused(tmp_path):
    folder = tmp_path / "not_a_checkpoint"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    with pytest.raises(FileNotFoundError, match=r"not_a_checkpoint is not a sharded checkpoint: no meta.pt"):
        export_checkpoint(folder, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_file_that_is_not_a_lightning_checkpoint_is_refused(tmp_path):
    weights = tmp_path / "weights.pt"
    torch.save({"linear.weight": torch.ones(2)}, weights)  # e.g. an earlier export
    with pytest.raises(ValueError, match=r"weights.pt is not a Lightning checkpoint: no 'state_dict' entry"):
        export_checkpoint(weights, tmp_path / "out.pt")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(CheckpointIntegrityError, match=r"notes.txt cannot be read"):
        export_checkpoint(text, tmp_path / "out.pt")


@pytest.mark.distributed
@pytest.mark.slow
def test_existing_output_is_refused_unless_overwrite(ep2_checkpoint, tmp_path):
    out = tmp_path / "out.pt"
    out.write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match=r"out.pt already exists; pass --overwrite"):
        export_checkpoint(ep2_checkpoint, out)
    assert out.read_bytes() == b"keep me"
    export_checkpoint(ep2_checkpoint, out, overwrite=True)
    assert sorted(torch.load(out, weights_only=True)) == sorted(reference_model().state_dict())
    with pytest.raises(IsADirectoryError, match="is a directory"):
        export_checkpoint(ep2_checkpoint, tmp_path, overwrite=True)
    with pytest.raises(ValueError, match="inside the checkpoint"):
        export_checkpoint(ep2_checkpoint, ep2_checkpoint / "weights.pt")


def _copy(checkpoint: Path, tmp_path: Path) -> tuple[Path, Path]:
    copy = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, copy)
    return copy, max(copy.glob("*.distcp"), key=lambda p: p.stat().st_size)


@pytest.mark.distributed
@pytest.mark.slow
def test_altered_shard_fails_verification_unless_no_verify(ep2_checkpoint, tmp_path):
    copy, shard = _copy(ep2_checkpoint, tmp_path)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match=rf"{shard.name}: SHA-256 .* differs"):
        export_checkpoint(copy, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()
    summary = export_checkpoint(copy, tmp_path / "out.pt", verify=False)  # the user's explicit choice
    assert not summary.verified and (tmp_path / "out.pt").is_file()


@pytest.mark.distributed
@pytest.mark.slow
def test_truncated_shard_is_refused_even_without_verification(ep2_checkpoint, tmp_path):
    copy, shard = _copy(ep2_checkpoint, tmp_path)
    with open(shard, "r+b") as file:
        file.truncate(shard.stat().st_size // 2)
    with pytest.raises(CheckpointIntegrityError, match=rf"{shard.name} is truncated"):
        export_checkpoint(copy, tmp_path / "out.pt", verify=False)
    assert not (tmp_path / "out.pt").exists()


def test_failed_write_leaves_the_previous_output_and_no_temporary_file(tmp_path):
    """A write that fails part-way (here past a file size limit: EFBIG, as a full disk gives ENOSPC)
    raises the OSError with its errno and the output's name, and leaves the previous export."""
    model = reference_model()
    checkpoint = tmp_path / "in" / "consolidated.ckpt"
    checkpoint.parent.mkdir()
    torch.save({"state_dict": model.state_dict()}, checkpoint)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "weights.pt"
    out.write_bytes(b"previous export")
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, limits[1]))  # a few of the model's ~1 MiB of tensors
    try:
        with pytest.raises(OSError, match=rf"Could not write {re.escape(str(out))}: File too large") as info:
            export_checkpoint(checkpoint, out, overwrite=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert info.value.errno == errno.EFBIG
    assert out.read_bytes() == b"previous export"
    assert sorted(p.name for p in out_dir.iterdir()) == ["weights.pt"]


def _export_in_a_process_group(rank: int, world_size: int, root: str) -> str:
    try:
        export_checkpoint(Path(root) / "ckpt", Path(root) / f"out{rank}.pt")
    except RuntimeError as err:
        return str(err)
    return "no error"


@pytest.mark.distributed
def test_export_refuses_to_run_inside_a_multi_rank_process_group(tmp_path):
    messages = run_distributed(_export_in_a_process_group, 2, str(tmp_path), timeout_s=60, tmp_dir=tmp_path)
    for message in messages:
        assert "runs in one process" in message, message


# ---------------------------------------------------------------------------------------- command line


def test_cli_export_writes_the_file_and_reports_it(tmp_path, capsys):
    checkpoint = tmp_path / "consolidated.ckpt"
    torch.save({"state_dict": reference_model().state_dict()}, checkpoint)
    summary = cli_main(["export", str(checkpoint), str(tmp_path / "out.pt")])
    assert summary.output == tmp_path / "out.pt" and summary.output.is_file()
    out = capsys.readouterr().out
    assert f"to {tmp_path / 'out.pt'}" in out and "tensors" in out


@pytest.mark.parametrize("problem", ["missing", "exists"])
def test_cli_export_errors_are_one_line_with_exit_status_1(problem, tmp_path, capsys):
    checkpoint = tmp_path / "consolidated.ckpt"
    out = tmp_path / "out.pt"
    if problem == "exists":
        torch.save({"state_dict": {"w": torch.ones(1)}}, checkpoint)
        out.write_bytes(b"keep")
    with pytest.raises(SystemExit) as info:
        cli_main(["export", str(checkpoint), str(out)])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("lightning-moe export: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert ("does not exist" if problem == "missing" else "--overwrite") in err


def test_cli_export_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["export", "only_one_path"])
    assert info.value.code == 2


@pytest.mark.slow
def test_console_script_help_lists_export_and_generate(tmp_path, capsys, monkeypatch):
    top = subprocess.run([console_script(), "--help"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=SUBPROCESS_TIMEOUT_S)
    assert top.returncode == 0, top.stderr
    assert "export" in top.stdout and "fit" in top.stdout and "generate" in top.stdout
    # The subcommand's own help, through the function the console script calls (in this process:
    # the script's dispatch to it is what the top-level help above exercised).
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        cli_main(["export", "--help"])
    assert info.value.code == 0
    sub = capsys.readouterr()
    for word in ("CKPT", "OUT", "--overwrite", "--no-verify", "weights_only=True"):
        assert word in sub.out, word
    assert list(tmp_path.iterdir()) == []
