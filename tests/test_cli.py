"""The ``lightning-moe`` CLI end to end: the main-job config, shortened, on 4 forked gloo ranks.

Every rank calls :func:`lightning_moe.cli.cli_main` in-process (the default process group exists,
so ``MoEStrategy`` launches nothing) with ``examples/configs/tiny_cpu.yaml`` as shipped and
overrides that keep a run to a few seconds: 8 training and 2 validation batches per epoch, a
60k-token corpus, no sanity check. The layout is the config's own (TP=2, ETP=1, EP=4: dense DP=2,
EDP=1). Logs go under ``tmp_path`` (``<save_dir>/tiny_cpu/<version>/``), and so do checkpoints:
the config sets no checkpoint ``dirpath``, so each run writes to its own
``<save_dir>/tiny_cpu/<version>/checkpoints`` (``MoEStrategy`` writes each checkpoint,
``last.ckpt`` included, as a directory of DCP shards plus ``meta.pt``); every rank ``chdir``s into
``tmp_path`` first.

* Fit (module fixture ``full_run``): 2 epochs uninterrupted (logger version ``full``).
* Resume (one launch in the test): 1 epoch (the config's logger settings: ``version_0``), then
  the documented resume command ``--trainer.logger.init_args.version=version_0 --ckpt_path last
  --trainer.max_epochs=2`` (the CSVLogger then deletes that version's ``metrics.csv`` and starts
  afresh, so each run's metrics are read right after it). Epoch 2's per-step train losses
  must equal the uninterrupted run's. The learning-rate schedule depends on ``max_epochs`` (cosine
  over ``estimated_stepping_batches``), but the config's ``warmup_steps: 20`` exceeds the 16 steps
  run here, so every step's learning rate is the same in the 1-epoch and the 2-epoch runs
  (``warmup_cosine`` is linear warm-up only).
* Then, in the same folder, a *different* model (4 experts instead of 8) with ``--ckpt_path last``
  and no version: a new version whose checkpoint folder is empty, so it starts from scratch instead
  of loading the other run's ``last.ckpt`` (a size mismatch when the folder was shared); and the
  other documented form, an explicit ``--ckpt_path .../version_0/checkpoints/last.ckpt``.

The forked ranks leave no global state in the pytest process (jsonargparse's parsing settings,
``rank_zero_only.rank``, ``PL_GLOBAL_SEED`` and the working directory change in the children
only), so no clean-up fixture is needed. ``--help`` runs the module's entry point in a forked child
(as ``python -m lightning_moe.cli`` does, without re-importing torch); ``--print_config`` and a bad
argument run the installed console script in subprocesses.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import multiprocessing
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import yaml
from helpers.console import console_script
from helpers.dist import run_distributed

from lightning_moe import cli as cli_module
from lightning_moe.cli import cli_main

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "configs" / "tiny_cpu.yaml"
WORLD = 4
"""The config's ``trainer.devices``."""
STEPS_PER_EPOCH = 8
FIRST_VERSION = "version_0"
"""The CSVLogger version of the first run in an empty ``save_dir`` (the config sets none)."""

SHORT_RUN = [
    f"--trainer.limit_train_batches={STEPS_PER_EPOCH}",
    "--trainer.limit_val_batches=2",
    "--trainer.log_every_n_steps=1",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    # 60k byte tokens: 3k for validation (2 replicas x 2 batches x 8 samples x 65 tokens fit),
    # the rest gives each of the 2 data-parallel replicas far more than 8 training batches.
    "--data.max_tokens=60000",
]
# A resumed run repeats the uninterrupted run's arithmetic on the same layout: bitwise equal
# (the CSV holds each logged float32 value exactly).
RESUME_LOSS_ATOL = 0.0
# The CLI subprocesses import torch + lightning (~4-6 s each on this machine).
SUBPROCESS_TIMEOUT_S = 120


def checkpoint_dir(log_dir: str | Path) -> Path:
    """Where the run logging to ``log_dir`` writes its checkpoints (the config sets no ``dirpath``)."""
    return Path(log_dir) / "checkpoints"


def _fit(save_dir: str, *extra: str) -> dict:
    """One ``lightning-moe fit`` of the shortened main job; what the checks need to know about it."""
    cli = cli_main([
        "fit", "--config", str(CONFIG), *SHORT_RUN, f"--trainer.logger.init_args.save_dir={save_dir}", *extra,
    ])
    trainer = cli.trainer
    callback = trainer.checkpoint_callback
    return {
        "log_dir": trainer.logger.log_dir,
        "global_step": trainer.global_step,
        "epochs_done": trainer.current_epoch,
        "ckpt_path": trainer.ckpt_path,
        "best_model_path": callback.best_model_path,
        "last_model_path": callback.last_model_path,
        "strategy": type(trainer.strategy).__name__,
        "world_size": trainer.world_size,
        # Read now: a later run logging to the same version deletes the file (CSVLogger does).
        "metrics": _read_metrics(trainer.logger.log_dir) if trainer.is_global_zero else None,
    }


def _full(rank: int, world_size: int, root: str) -> dict:
    os.chdir(root)  # anything written relative to the working directory lands in tmp_path
    return _fit(str(Path(root) / "logs"), "--trainer.max_epochs=2", "--trainer.logger.init_args.version=full")


def _split(rank: int, world_size: int, root: str) -> dict:
    os.chdir(root)
    save_dir = str(Path(root) / "logs")
    out = {"first": _fit(save_dir, "--trainer.max_epochs=1")}
    try:
        out["resumed"] = _fit(
            save_dir, "--trainer.max_epochs=2", f"--trainer.logger.init_args.version={FIRST_VERSION}",
            "--ckpt_path=last",
        )
    except BaseException:  # e.g. DCP's CheckpointException (a BaseException), raised on every rank alike
        out["resumed_error"] = traceback.format_exc()  # reported by the resume test; the next run still goes
    # Another model in the same folder, `--ckpt_path last` without a version (one 2-batch epoch;
    # "1" would parse as the float 1.0, i.e. the whole epoch).
    out["other_model"] = _fit(
        save_dir, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--model.model.moe.num_experts=4",
        "--ckpt_path=last",
    )
    # The other documented form: run 0's last.ckpt by path (already at epoch 2: nothing left to train).
    last = checkpoint_dir(out["first"]["log_dir"]) / "last.ckpt"
    out["explicit"] = _fit(save_dir, "--trainer.max_epochs=2", f"--ckpt_path={last}")
    return out


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cli_fit")
    ranks = run_distributed(_full, WORLD, str(root), timeout_s=120, tmp_dir=root)
    return {"ranks": ranks, "root": root, **ranks[0]}


@pytest.fixture(scope="module")
def split_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cli_resume")
    return run_distributed(_split, WORLD, str(root), timeout_s=180, tmp_dir=root)[0]


def _read_metrics(log_dir: str | Path) -> list[dict]:
    if not (Path(log_dir) / "metrics.csv").is_file():
        return []  # a run with nothing left to train logs nothing
    with open(Path(log_dir) / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def _column(rows: list[dict], name: str, epoch: int | None = None) -> dict[int, float]:
    """``{step: value}`` of the rows that have ``name`` (optionally of one epoch only)."""
    return {
        int(row["step"]): float(row[name])
        for row in rows
        if row.get(name) and (epoch is None or int(row["epoch"]) == epoch)
    }


# ---------------------------------------------------------------------------------------- fit


@pytest.mark.distributed
@pytest.mark.slow
def test_fit_runs_on_every_rank_with_the_config_layout(full_run):
    for rank, result in enumerate(full_run["ranks"]):
        assert result["strategy"] == "MoEStrategy", rank
        assert result["world_size"] == WORLD, rank
        assert result["global_step"] == 2 * STEPS_PER_EPOCH, rank
        assert result["epochs_done"] == 2, rank
        assert result["log_dir"] == full_run["log_dir"], rank
    # Only the logger's save_dir was written (the harness's rendezvous files aside), not the cwd.
    written = {p.name for p in full_run["root"].iterdir() if not p.name.startswith("filestore-")}
    assert written == {"logs"}, written
    assert Path(full_run["log_dir"]) == full_run["root"] / "logs" / "tiny_cpu" / "full"


@pytest.mark.distributed
@pytest.mark.slow
def test_fit_writes_metrics_with_falling_val_loss(full_run):
    rows = full_run["metrics"]
    train = _column(rows, "train_loss")
    assert sorted(train) == list(range(2 * STEPS_PER_EPOCH)), sorted(train)  # every step logged
    for epoch in (0, 1):
        assert len(_column(rows, "train_loss", epoch)) == STEPS_PER_EPOCH, epoch
    val_rows = [row for row in rows if row.get("val_loss")]
    assert [int(row["epoch"]) for row in val_rows] == [0, 1]  # one per epoch
    val = [float(row["val_loss"]) for row in val_rows]
    assert all(math.isfinite(v) for v in (*train.values(), *val))
    assert val[-1] < val[0], val
    assert all(row.get("val_ppl") for row in val_rows)


@pytest.mark.distributed
@pytest.mark.slow
def test_fit_writes_sharded_checkpoints(full_run):
    log_dir = Path(full_run["log_dir"])
    checkpoints = checkpoint_dir(log_dir)
    last = checkpoints / "last.ckpt"
    assert Path(full_run["last_model_path"]) == last
    best = Path(full_run["best_model_path"])
    assert best.parent == checkpoints and best.name.startswith("epoch="), best
    for path in (last, best):
        assert path.is_dir(), sorted(p.name for p in checkpoints.iterdir())
        assert (path / "meta.pt").is_file(), sorted(p.name for p in path.iterdir())
        assert any(path.glob("*.distcp")), sorted(p.name for p in path.iterdir())
    assert len(list(checkpoints.iterdir())) == 2  # save_top_k=1 pruned the other epoch's directory
    assert (log_dir / "config.yaml").is_file()  # SaveConfigCallback


# ---------------------------------------------------------------------------------------- resume


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_from_last_continues_exactly(split_run, full_run):
    first = split_run["first"]
    assert first["global_step"] == STEPS_PER_EPOCH
    assert Path(first["log_dir"]).name == FIRST_VERSION
    assert Path(first["last_model_path"]).parent == checkpoint_dir(first["log_dir"])  # its own version's
    assert Path(first["last_model_path"]).name == "last.ckpt"
    if "resumed_error" in split_run:
        pytest.fail("the resumed run raised:\n" + split_run["resumed_error"])
    resumed = split_run["resumed"]
    assert resumed["ckpt_path"] == first["last_model_path"]
    assert resumed["log_dir"] == first["log_dir"]
    assert resumed["global_step"] == 2 * STEPS_PER_EPOCH

    # Epoch 0: the same seed and data, so the same run; epoch 1: continued from the checkpoint.
    for epoch, rows in ((0, first["metrics"]), (1, resumed["metrics"])):
        want = _column(full_run["metrics"], "train_loss", epoch)
        got = _column(rows, "train_loss", epoch)
        assert len(want) == STEPS_PER_EPOCH and sorted(got) == sorted(want), (epoch, sorted(got), sorted(want))
        for step, value in want.items():
            assert got[step] == pytest.approx(value, rel=0, abs=RESUME_LOSS_ATOL), (epoch, step, got[step], value)
        want_val = _column(full_run["metrics"], "val_loss", epoch)
        assert _column(rows, "val_loss", epoch) == pytest.approx(want_val, rel=0, abs=RESUME_LOSS_ATOL), epoch
    assert not _column(resumed["metrics"], "train_loss", 0), "the resumed run trained epoch 0 again"


@pytest.mark.distributed
@pytest.mark.slow
def test_another_run_in_the_same_folder_does_not_resume_from_its_checkpoint(split_run):
    """``tiny_cpu.yaml`` used to fix the checkpoint folder, so ``--ckpt_path last`` in a new run (here
    a model with 4 experts instead of 8) loaded the previous run's ``last.ckpt``: a size mismatch.
    Checkpoints now live per logger version: a new version starts from scratch."""
    if "resumed_error" in split_run:
        pytest.fail("the resumed run raised:\n" + split_run["resumed_error"])
    other, first = split_run["other_model"], split_run["first"]
    assert other["ckpt_path"] is None, f"the new run loaded {other['ckpt_path']}"
    assert Path(other["log_dir"]).name == "version_1" and other["global_step"] == 2
    assert Path(other["last_model_path"]).parent == checkpoint_dir(other["log_dir"])
    assert (checkpoint_dir(first["log_dir"]) / "last.ckpt").is_dir()  # run 0's checkpoint is untouched


@pytest.mark.distributed
@pytest.mark.slow
def test_documented_resume_by_path_finds_the_checkpoint(split_run):
    """The config comment's second form: ``--ckpt_path <save_dir>/tiny_cpu/version_0/checkpoints/last.ckpt``."""
    explicit, first = split_run["explicit"], split_run["first"]
    assert explicit["ckpt_path"] == str(checkpoint_dir(first["log_dir"]) / "last.ckpt")
    assert explicit["global_step"] == 2 * STEPS_PER_EPOCH  # restored at the end of epoch 2: nothing retrained
    assert explicit["log_dir"] != first["log_dir"]  # logged to a new version


def test_config_documents_the_resume_commands():
    text = CONFIG.read_text()
    (checkpoint,) = [cb for cb in yaml.safe_load(text)["trainer"]["callbacks"] if cb["class_path"].endswith("ModelCheckpoint")]
    assert "dirpath" not in checkpoint["init_args"], checkpoint  # per logger version
    assert "--trainer.logger.init_args.version=N --ckpt_path last" in text
    assert "--ckpt_path lightning_logs/tiny_cpu/version_N/checkpoints/last.ckpt" in text


# ---------------------------------------------------------------------------------------- help / print_config


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)


def _help_main(conn, args: list[str], cwd: Path) -> None:
    """Body of :func:`_run_module`'s forked child: ``lightning_moe.cli.main()`` with ``args`` as its argv."""
    code, out, err = 1, io.StringIO(), io.StringIO()
    try:
        os.chdir(cwd)
        # As in a subprocess with captured output: no terminal on the standard streams (the help's
        # line width is the 80-column fallback), and nothing inherited from pytest's capture.
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        sys.argv = [str(Path(cli_module.__file__)), *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli_module.main()
                code = 0
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        err.write(traceback.format_exc())
    finally:
        try:
            conn.send((code, out.getvalue(), err.getvalue()))
            conn.close()
        finally:
            os._exit(0)


def _run_module(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m lightning_moe.cli *args`` run by the module's own entry point (``main()``, which
    reads ``sys.argv``) in a forked copy of this process: torch and lightning are imported already,
    which is what a subprocess spends its seconds on. The console script itself runs as a real
    subprocess below (``--print_config``, bad arguments)."""
    ctx = multiprocessing.get_context("fork")
    recv_conn, send_conn = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_help_main, args=(send_conn, args, cwd))
    process.start()
    send_conn.close()
    try:
        if not recv_conn.poll(SUBPROCESS_TIMEOUT_S):
            pytest.fail(f"lightning_moe.cli {args} did not finish in {SUBPROCESS_TIMEOUT_S} s")
        code, out, err = recv_conn.recv()
    finally:
        if process.is_alive():
            process.kill()
        process.join()
    return subprocess.CompletedProcess([sys.executable, "-m", "lightning_moe.cli", *args], code, out, err)


@pytest.mark.slow
def test_fit_help_shows_model_data_and_strategy(tmp_path):
    result = _run_module(["fit", "--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # model and data are any class (class_path), the reference ones by default.
    assert "--model CONFIG | CLASS_PATH_OR_NAME" in out and "--model.help" in out
    assert "lightning_moe.lit.MoELanguageModel" in out
    assert "--data CONFIG | CLASS_PATH_OR_NAME" in out and "lightning_moe.lit.TextDataModule" in out
    # The strategy option, with MoEStrategy among the known classes.
    assert "--trainer.strategy" in out
    assert "lightning_moe.strategies.MoEStrategy" in out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_reference_model_help_shows_config_docstrings(tmp_path):
    result = _run_module(["fit", "--model.help", "MoELanguageModel",
                   "--model.model.help", "MoETransformerConfig"], tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # MoETransformerConfig field docstrings. ``model`` is optional (``init_from`` may give the
    # configuration instead) and ``moe`` is ``MoEConfig | None``: jsonargparse shows the fields of an
    # optional dataclass under its own help (``--model.model.help``, ``--model.model.moe.help``).
    assert "--model.model.num_kv_heads" in out
    assert "Key/value heads for grouped-query attention" in out
    assert "--model.model.moe.help" in out
    module_help = _run_module(["fit", "--model.help", "MoELanguageModel"], tmp_path)
    assert module_help.returncode == 0, module_help.stderr
    for option in ("--model.learning_rate", "--model.init_from", "--model.model.help"):
        assert option in module_help.stdout, option


@pytest.mark.slow
def test_moe_config_help_shows_field_docstrings(tmp_path):
    result = _run_module(
        ["fit", "--model.help", "MoELanguageModel",
         "--model.model.help", "MoETransformerConfig", "--model.model.moe.help"],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "--model.model.moe.top_k" in result.stdout
    assert "Experts per token" in result.stdout
    assert "moe_router_topk" in result.stdout  # the Megatron flag name from the docstring


@pytest.mark.slow
def test_strategy_help_shows_moe_strategy_arguments(tmp_path):
    result = _run_module(["fit", "--trainer.strategy.help", "MoEStrategy"], tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ("tensor_parallel_size", "expert_parallel_size", "expert_tensor_parallel_size", "dispatcher"):
        assert f"--trainer.strategy.{name}" in result.stdout, name


@pytest.mark.slow
def test_console_script_print_config_exits_zero(tmp_path):
    result = _run([console_script(), "fit", "--config", str(CONFIG), "--print_config"], tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "class_path: lightning_moe.strategies.MoEStrategy" in out
    assert "tensor_parallel_size: 2" in out and "expert_parallel_size: 4" in out
    assert "top_k: 2" in out
    # The YAML's model/data sections (no class_path) configure the reference classes.
    assert "class_path: lightning_moe.lit.MoELanguageModel" in out
    assert "class_path: lightning_moe.lit.TextDataModule" in out
    assert "max_tokens: 600000" in out
    assert list(tmp_path.iterdir()) == []  # printing the config trains and writes nothing


@pytest.mark.slow
def test_console_script_reports_bad_arguments(tmp_path):
    result = _run([console_script(), "fit", "--config", str(CONFIG), "--trainer.max_epochs=two"], tmp_path)
    assert result.returncode == 2, result.stderr  # argparse's usage-error status
    assert "max_epochs" in result.stderr
