"""`MoEStrategy` checkpoints are verified before loading, and every failure names the file.

A 2-rank fit (EP=2) saves ``epoch=0.ckpt`` and ``epoch=1.ckpt`` (module fixture); each test damages
a copy and resumes from it on 2 ranks. ``meta.pt`` records a save id and a SHA-256 digest per file;
flipped bytes in tensor data, a shard or ``.metadata`` copied from the other checkpoint, missing
or truncated files and an unreadable ``meta.pt`` are refused, naming the file, on every rank.
Checkpoints without digests (earlier versions) load with a warning; ``verify_checkpoints=False``
skips the digests but not the completeness checks. The consolidated single-file format is
replaced atomically and refuses code and damaged files too, and a bytes item smuggled into a
self-consistent sharded checkpoint (digests rewritten, as an attacker would) runs no code.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from helpers.dist import run_distributed
from security.crafting import write_meta
from strategies.checkpoint_runs import (
    STEPS_PER_EPOCH,
    MakeDir,
    assert_same_state,
    fit,
    flip_tensor_byte,
    redeclare_as_bytes_item,
)

from lightning_moe.checkpoint.integrity import CheckpointIntegrityError
from lightning_moe.strategies import MoEStrategy
from lightning_moe.strategies.checkpointing import MoECheckpointing

pytestmark = pytest.mark.distributed

WORLD = 2


def _re(path: Path | str) -> str:
    return re.escape(str(path))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """epoch=0.ckpt and epoch=1.ckpt of a 2-rank fit, and the state captured before each save."""
    root = tmp_path_factory.mktemp("integrity")

    def save(rank: int, world_size: int, ckpt_dir: str) -> dict:
        return fit(world_size, Path(ckpt_dir), filename="{epoch}", save_top_k=-1).at_epoch_end

    (states, _) = run_distributed(save, WORLD, str(root / "ckpts"), tmp_dir=root)
    return {"dir": root / "ckpts", "states": states}


def _copy(saved: dict, name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copytree(saved["dir"] / name, target)
    return target


def _metadata(ckpt: Path):
    with open(ckpt / ".metadata", "rb") as file:
        return pickle.load(file)  # written by the fixture: trusted


def _largest_item(ckpt: Path, shard: str) -> torch.Tensor:
    """The largest tensor stored in ``shard``, read back from its own bytes."""
    infos = [info for info in _metadata(ckpt).storage_data.values() if info.relative_path == shard]
    info = max(infos, key=lambda i: i.length)
    data = (ckpt / shard).read_bytes()[info.offset: info.offset + info.length]
    return torch.load(io.BytesIO(data), weights_only=True)


def _resume(rank: int, world_size: int, ckpt: str, verify: bool = True) -> dict:
    strategy = MoEStrategy(expert_parallel_size=2)
    strategy.checkpointing = MoECheckpointing(strategy, verify_checkpoints=verify)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        capture = fit(world_size, ckpt_path=ckpt, strategy=strategy, max_epochs=3)
    return {"start": capture.at_train_start, "warnings": [str(w.message) for w in caught]}


def _resume_fails(rank: int, world_size: int, ckpt: str, error: type, pattern: str, verify: bool = True) -> str:
    strategy = MoEStrategy(expert_parallel_size=2)
    strategy.checkpointing = MoECheckpointing(strategy, verify_checkpoints=verify)
    with pytest.raises(error, match=pattern) as caught:
        fit(world_size, ckpt_path=ckpt, strategy=strategy, max_epochs=3)
    return str(caught.value)


def _assert_fails_everywhere(tmp_path, ckpt: Path, error: type, pattern: str, verify: bool = True) -> None:
    messages = run_distributed(_resume_fails, WORLD, str(ckpt), error, pattern, verify, tmp_dir=tmp_path)
    assert len(set(messages)) == 1, messages  # every rank raises the same error


def test_intact_checkpoint_resumes_exactly(saved, tmp_path):
    for rank, result in enumerate(run_distributed(_resume, WORLD, str(saved["dir"] / "epoch=1.ckpt"), tmp_dir=tmp_path)):
        assert result["start"]["epoch"] == 2
        assert_same_state(result["start"], saved["states"][1], f"rank {rank}")
        assert not [w for w in result["warnings"] if "checksum" in w], result["warnings"]


def test_flipped_bytes_in_tensor_data_are_detected(saved, tmp_path):
    """Library bug: the flipped float loaded silently."""
    ckpt = _copy(saved, "epoch=1.ckpt", tmp_path)
    flip_tensor_byte(ckpt / "__1_0.distcp", _largest_item(ckpt, "__1_0.distcp"))
    _assert_fails_everywhere(tmp_path, ckpt, CheckpointIntegrityError,
                             rf"{_re(ckpt / '__1_0.distcp')}: SHA-256 .* differs from the one recorded")


def test_shard_copied_from_another_step_is_detected(saved, tmp_path):
    """Library bug: the other step's shard (same size) loaded silently."""
    ckpt = _copy(saved, "epoch=1.ckpt", tmp_path)
    shutil.copy(saved["dir"] / "epoch=0.ckpt" / "__1_0.distcp", ckpt / "__1_0.distcp")
    assert (ckpt / "__1_0.distcp").stat().st_size == (saved["dir"] / "epoch=1.ckpt" / "__1_0.distcp").stat().st_size
    _assert_fails_everywhere(tmp_path, ckpt, CheckpointIntegrityError,
                             rf"{_re(ckpt / '__1_0.distcp')}: SHA-256 .* differs from the one recorded")


def test_dcp_metadata_of_another_save_is_detected(saved, tmp_path):
    """With digests on, its SHA-256 refuses it before it is unpickled; without, its save id does."""
    ckpt = _copy(saved, "epoch=1.ckpt", tmp_path)
    shutil.copy(saved["dir"] / "epoch=0.ckpt" / ".metadata", ckpt / ".metadata")
    _assert_fails_everywhere(tmp_path, ckpt, CheckpointIntegrityError,
                             rf"{_re(ckpt / '.metadata')} belongs to another save \(save id \w+, meta.pt records \w+\)",
                             verify=False)


def test_verification_off_skips_digests_not_completeness(saved, tmp_path):
    flipped = _copy(saved, "epoch=1.ckpt", tmp_path / "flipped")
    flip_tensor_byte(flipped / "__1_0.distcp", _largest_item(flipped, "__1_0.distcp"))
    for result in run_distributed(_resume, WORLD, str(flipped), False, tmp_dir=tmp_path):
        assert result["start"]["global_step"] == 2 * STEPS_PER_EPOCH  # loaded: nothing hashed the data
    truncated = _copy(saved, "epoch=1.ckpt", tmp_path / "truncated")
    with open(truncated / "__1_0.distcp", "r+b") as file:
        file.truncate(file.seek(0, os.SEEK_END) - 100)
    _assert_fails_everywhere(tmp_path, truncated, CheckpointIntegrityError,
                             rf"{_re(truncated / '__1_0.distcp')} is truncated", verify=False)


def test_checkpoint_without_digests_loads_with_a_warning(saved, tmp_path):
    """What earlier versions wrote: no save id, no per-file records in meta.pt."""
    ckpt = _copy(saved, "epoch=1.ckpt", tmp_path)
    meta = torch.load(ckpt / "meta.pt", weights_only=True)
    meta["lightning_moe"] = {k: v for k, v in meta["lightning_moe"].items() if k in ("layout", "optimizer_param_groups")}
    torch.save(meta, ckpt / "meta.pt")
    (ckpt / "meta.pt.json").unlink()
    ranks = run_distributed(_resume, WORLD, str(ckpt), tmp_dir=tmp_path)
    for rank, result in enumerate(ranks):
        assert_same_state(result["start"], saved["states"][1], f"rank {rank}")
    assert any(f"{ckpt} has no checksums" in w for w in ranks[0]["warnings"]), ranks[0]["warnings"]


def _damaged_copies(saved: dict, tmp_path: Path) -> list[tuple[Path, type, str]]:
    """(checkpoint, error, pattern) for each kind of damage."""
    cases = []

    def copy(name: str) -> Path:
        return _copy(saved, "epoch=1.ckpt", tmp_path / name)

    ckpt = copy("no_meta")
    (ckpt / "meta.pt").unlink()
    cases.append((ckpt, FileNotFoundError, rf"{_re(ckpt)} is not a complete sharded lightning_moe checkpoint: no meta\.pt"))
    ckpt = copy("no_dcp_metadata")
    (ckpt / ".metadata").unlink()
    cases.append((ckpt, FileNotFoundError, rf"{_re(ckpt)} is not a complete sharded lightning_moe checkpoint: no \.metadata"))
    ckpt = copy("no_shard")
    (ckpt / "__1_0.distcp").unlink()
    cases.append((ckpt, FileNotFoundError, rf"{_re(ckpt / '__1_0.distcp')} is missing"))
    ckpt = copy("truncated_shard")
    with open(ckpt / "__0_0.distcp", "r+b") as file:
        file.truncate(10)
    cases.append((ckpt, CheckpointIntegrityError, rf"{_re(ckpt / '__0_0.distcp')} is truncated: 10 bytes, .* needs"))
    ckpt = copy("truncated_meta")
    with open(ckpt / "meta.pt", "r+b") as file:
        file.truncate(100)
    cases.append((ckpt, CheckpointIntegrityError, rf"{_re(ckpt / 'meta.pt')} is 100 bytes, the save wrote \d+"))
    missing = tmp_path / "does_not_exist.ckpt"
    cases.append((missing, FileNotFoundError, rf"Checkpoint {_re(missing)} does not exist"))
    return cases


def _every_damage_fails(rank: int, world_size: int, cases: list) -> str:
    for ckpt, error, pattern in cases:
        _resume_fails(rank, world_size, str(ckpt), error, pattern)
    return "ok"


def test_incomplete_or_unreadable_checkpoints_name_the_file(saved, tmp_path):
    """Library bug: a truncated meta.pt raised a zip error naming no file; a missing shard or
    .metadata surfaced as DCP's CheckpointException."""
    cases = _damaged_copies(saved, tmp_path)
    assert run_distributed(_every_damage_fails, WORLD, cases, tmp_dir=tmp_path) == ["ok"] * WORLD


def test_bytes_item_in_a_self_consistent_checkpoint_runs_no_code(saved, tmp_path):
    """A tensor re-declared as a pickled bytes item (appended to its shard), with the digests in
    meta.pt rewritten to match: DCP's default planner would torch.load(weights_only=False) it."""
    ckpt, marker, key = _copy(saved, "epoch=1.ckpt", tmp_path), tmp_path / "marker", "state_dict.net.head.bias"
    redeclare_as_bytes_item(ckpt, key, MakeDir(marker))
    meta = torch.load(ckpt / "meta.pt", weights_only=True)
    for name, record in meta["lightning_moe"].get("files", {}).items():
        record.update(size=(ckpt / name).stat().st_size, sha256=hashlib.sha256((ckpt / name).read_bytes()).hexdigest())
    write_meta(ckpt, meta)  # and meta.pt's own record
    _assert_fails_everywhere(tmp_path, ckpt, pickle.UnpicklingError, rf"declares '{key}' as a pickled \(bytes\) item")
    assert not marker.exists(), "the crafted checkpoint ran code"


# -- the consolidated single-file format --------------------------------------------------------


def _consolidated(rank: int, world_size: int, ckpt_dir: str) -> dict:
    strategy = MoEStrategy(expert_parallel_size=2, save_distributed_checkpoint=False)
    # epoch=0.ckpt, last.ckpt, epoch=1.ckpt (epoch=0 pruned), last.ckpt replaced
    saved = fit(world_size, Path(ckpt_dir), strategy=strategy, filename="{epoch}", save_top_k=1, save_last=True)
    listing = sorted(os.listdir(ckpt_dir))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*consolidated checkpoint: it holds the model weights only")
        loaded = fit(world_size, ckpt_path=Path(ckpt_dir) / "last.ckpt", max_epochs=3)
    return {"saved": saved.at_epoch_end[1]["weights"], "loaded": loaded.at_train_start["weights"], "listing": listing}


def _consolidated_damage_fails(rank: int, world_size: int, truncated: str, code: str) -> str:
    _resume_fails(rank, world_size, truncated, CheckpointIntegrityError, rf"{_re(truncated)} cannot be read")
    _resume_fails(rank, world_size, code, pickle.UnpicklingError, rf"{_re(code)} holds objects other than tensors")
    return "ok"


def test_consolidated_checkpoint_is_replaced_atomically_and_checked(tmp_path):
    ckpt_dir = tmp_path / "ckpts"
    ranks = run_distributed(_consolidated, WORLD, str(ckpt_dir), tmp_dir=tmp_path)
    assert ranks[0]["listing"] == ["epoch=1.ckpt", "last.ckpt"]
    for rank, result in enumerate(ranks):
        assert result["loaded"].keys() == result["saved"].keys()
        for name, value in result["saved"].items():
            torch.testing.assert_close(result["loaded"][name], value, rtol=0, atol=0, msg=lambda m, n=name, r=rank: f"{r} {n}: {m}")

    truncated, code, marker = tmp_path / "truncated.ckpt", tmp_path / "code.ckpt", tmp_path / "marker"
    shutil.copy(ckpt_dir / "last.ckpt", truncated)
    with open(truncated, "r+b") as file:
        file.truncate(file.seek(0, os.SEEK_END) // 2)
    checkpoint = torch.load(ckpt_dir / "last.ckpt", weights_only=True)
    checkpoint["hyper_parameters"] = {"payload": MakeDir(marker)}
    torch.save(checkpoint, code)
    assert run_distributed(_consolidated_damage_fails, WORLD, str(truncated), str(code), tmp_dir=tmp_path) == ["ok"] * 2
    assert not marker.exists(), "the consolidated checkpoint ran code"
