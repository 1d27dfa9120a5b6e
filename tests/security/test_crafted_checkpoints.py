"""Crafted sharded checkpoints: no read outside the folder, no change to the process, no allocation
the files do not back, no deletion outside the run.

One 1-rank fit saves ``epoch=0.ckpt`` (module fixture); each test crafts a copy as an attacker
would (records rewritten to stay self-consistent, :mod:`security.crafting`) and checks that
``export_checkpoint`` or a resume refuses it naming the file, and that nothing outside the
checkpoint changed (:func:`~security.crafting.snapshot`). Payloads only create marker folders.
"""

from __future__ import annotations

import copyreg
import dataclasses
import hashlib
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.dist import run_distributed
from security.crafting import read_meta, read_metadata, snapshot, write_meta, write_metadata
from strategies.checkpoint_runs import fit
from torch.distributed.checkpoint import metadata as dcp_metadata

from lightning_moe.checkpoint.export import export_checkpoint
from lightning_moe.checkpoint.integrity import CheckpointIntegrityError
from lightning_moe.checkpoint.security import read_dcp_metadata
from lightning_moe.strategies.checkpointing import MoECheckpointing

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CKPT = "epoch=0.ckpt"
FIT = {"max_epochs": 1, "ep": 1, "filename": "{epoch}", "save_top_k": -1}
"""The saving fit: one rank, one epoch, ``epoch=0.ckpt``."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("crafted")
    run_distributed(lambda rank, world, d: fit(world, Path(d), **FIT) and None, 1, str(root / "ckpts"), tmp_dir=root)
    return root / "ckpts" / CKPT


def _copy(saved: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(saved, target)
    return target


def _export_refused(ckpt: Path, tmp_path: Path, pattern: str, error: type = CheckpointIntegrityError) -> str:
    """Export ``ckpt``: it must raise ``error`` matching ``pattern``, write nothing and change nothing."""
    before = snapshot(tmp_path)
    with pytest.raises(error, match=pattern) as caught:
        export_checkpoint(ckpt, tmp_path / "out" / "model.pt")
    assert not (tmp_path / "out").exists()
    assert snapshot(tmp_path) == before
    return str(caught.value)


def _largest_tensor(metadata) -> str:
    return max((k for k in metadata.state_dict_metadata if k.startswith("state_dict.")),
               key=lambda k: metadata.state_dict_metadata[k].size.numel())


# -- reads outside the folder ----------------------------------------------------------------------


def test_symlinked_shard_is_refused(saved, tmp_path):
    """Library bug: a shard linked to a file outside (here an identical copy) loaded, "checksums verified"."""
    ckpt = _copy(saved, tmp_path)
    outside = tmp_path / "outside.distcp"
    shutil.move(ckpt / "__0_0.distcp", outside)
    (ckpt / "__0_0.distcp").symlink_to(outside)
    _export_refused(ckpt, tmp_path, rf"{re.escape(str(ckpt / '__0_0.distcp'))} is a symbolic link \(to {re.escape(str(outside))}\)")


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_file_records_outside_the_folder_are_refused(saved, tmp_path, where):
    """Library bug: meta.pt's records named any file; the error then gave its size and 64 bits of its hash."""
    ckpt, secret = _copy(saved, tmp_path), tmp_path / "secret.bin"
    secret.write_bytes(b"not for the checkpoint" * 10)
    name = "../secret.bin" if where == "relative" else str(secret)
    meta = read_meta(ckpt)
    meta["lightning_moe"]["files"][name] = {"size": secret.stat().st_size, "sha256": "0" * 64}
    write_meta(ckpt, meta)
    message = _export_refused(ckpt, tmp_path, rf"names the file {re.escape(repr(name))}, which is not a file name inside")
    assert hashlib.sha256(secret.read_bytes()).hexdigest()[:16] not in message


# -- .metadata: nothing unpickled unchecked, nothing shared changed ---------------------------------


def _enum_build_payload() -> bytes:
    """GLOBAL _MEM_FORMAT_ENCODING; REDUCE (0,) -> the shared member; BUILD {"_value_": 99}; STOP."""
    state = pickle.dumps({"_value_": 99}, protocol=2)[2:-1]
    return b"\x80\x04ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x00\x85R" + state + b"b."


def test_build_on_an_enum_member_is_refused(tmp_path):
    """Library bug: accepted, and every later save failed ("99 is not a valid _MEM_FORMAT_ENCODING")."""
    member = dcp_metadata._MEM_FORMAT_ENCODING(0)
    (tmp_path / ".metadata").write_bytes(_enum_build_payload())
    try:
        with pytest.raises(pickle.UnpicklingError, match=r"Refusing to set the state of an instance of .*_MEM_FORMAT_ENCODING"):
            read_dcp_metadata(tmp_path / ".metadata")
        assert member.value == 0
        dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "after")  # saves still work
    finally:
        member.__dict__["_value_"] = 0


def test_ext_opcodes_are_refused(tmp_path):
    """copyreg's extension cache resolves a global without find_class: EXT1 + REDUCE called os.makedirs."""
    marker, code = tmp_path / "marker", 0xF1
    copyreg.add_extension("os", "makedirs", code)
    try:
        pickle.loads(b"\x80\x02\x82" + bytes([code]) + b".")  # any unpickling of the code fills the cache
        args = pickle.dumps((str(marker),), protocol=2)[2:-1]
        (tmp_path / ".metadata").write_bytes(b"\x80\x02\x82" + bytes([code]) + args + b"R.")
        with pytest.raises(pickle.UnpicklingError, match=r"Refusing the pickle extension-registry opcode"):
            read_dcp_metadata(tmp_path / ".metadata")
    finally:
        copyreg.remove_extension("os", "makedirs", code)
    assert not marker.exists(), "the crafted .metadata ran code"


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_metadata_is_checked_before_it_is_unpickled(saved, tmp_path, verify):
    """A replaced .metadata is refused by its recorded size (and digest) before the unpickler runs."""
    ckpt = _copy(saved, tmp_path)
    member = dcp_metadata._MEM_FORMAT_ENCODING(0)
    (ckpt / ".metadata").write_bytes(_enum_build_payload())
    before = snapshot(tmp_path)
    try:
        with pytest.raises(CheckpointIntegrityError, match=rf"{re.escape(str(ckpt / '.metadata'))} is \d+ bytes, the save wrote"):
            export_checkpoint(ckpt, tmp_path / "out" / "model.pt", verify=verify)
        assert member.value == 0
    finally:
        member.__dict__["_value_"] = 0
    assert snapshot(tmp_path) == before


def test_a_changed_meta_pt_is_refused_before_it_is_unpickled(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    meta = read_meta(ckpt)
    meta["epoch"] = 7
    torch.save(meta, ckpt / "meta.pt")  # its record in meta.pt.json left as it was
    _export_refused(ckpt, tmp_path, rf"{re.escape(str(ckpt / 'meta.pt'))}.*(bytes, the save wrote|SHA-256 .* differs)")


# -- .metadata entries: coverage and sizes ---------------------------------------------------------


def _empty_chunks(metadata, key):
    metadata.state_dict_metadata[key].chunks = []


def _grown_shape(metadata, key):
    item = metadata.state_dict_metadata[key]
    item.size = torch.Size([item.size[0] * 512, *item.size[1:]])


def _chunk_beyond_storage(metadata, key):
    item = metadata.state_dict_metadata[key]
    item.size = torch.Size([item.size[0] * 512, *item.size[1:]])
    (chunk,) = item.chunks
    item.chunks = [dataclasses.replace(chunk, sizes=item.size)]


def _shared_storage(metadata, key):
    """A second tensor whose bytes are the same record's: reading them twice doubles the allocation."""
    item = metadata.state_dict_metadata[key]
    (index,) = [i for i in metadata.storage_data if i.fqn == key]
    metadata.state_dict_metadata[key + "_copy"] = item
    metadata.planner_data[key + "_copy"] = (*metadata.planner_data[key][:-1], metadata.planner_data[key][-1] + "_copy")
    metadata.storage_data[dcp_metadata.MetadataIndex(key + "_copy", index.offset)] = metadata.storage_data[index]


def _planner_list(metadata, key):
    metadata.planner_data[key] = ("state_dict", "net", 10**6)  # an export would build a list of 10^6 items


_CRAFTS = {
    "empty_chunks": (_empty_chunks, r"the chunks of '{key}' cover 0 of its \d+ elements"),
    "grown_shape": (_grown_shape, r"the chunks of '{key}' cover \d+ of its \d+ elements"),
    "chunk_beyond_storage": (_chunk_beyond_storage, r"the chunk of '{key}' at \[0, 0.*\] needs \d+ bytes but its record in __0_0\.distcp holds \d+"),
    "shared_storage": (_shared_storage, r"two storage records overlap in __0_0\.distcp"),
    "planner_list": (_planner_list, r"planner_data gives '{key}' the path .* not made of its own parts"),
}


@pytest.mark.parametrize("craft", sorted(_CRAFTS))
def test_entries_the_files_do_not_back_are_refused(saved, tmp_path, craft):
    """Library bug: export wrote uninitialised memory ("checksums verified") or more than the files hold."""
    ckpt = _copy(saved, tmp_path)
    metadata = read_metadata(ckpt)
    key = _largest_tensor(metadata)
    edit, pattern = _CRAFTS[craft]
    edit(metadata, key)
    write_metadata(ckpt, metadata)
    _export_refused(ckpt, tmp_path, re.escape(str(ckpt / ".metadata")) + ": " + pattern.format(key=re.escape(key)))


# -- resume: entries against the model, callback paths ---------------------------------------------


def _resume_cases(rank: int, world: int, cases: list[tuple[str, str]]) -> str:
    for ckpt, pattern in cases:
        with pytest.raises(CheckpointIntegrityError, match=pattern):
            fit(world, ckpt_path=ckpt, max_epochs=2, ep=1)
    return "ok"


def _bfloat16(ckpt: Path, metadata, key: str) -> str:
    props = metadata.state_dict_metadata[key].properties
    metadata.state_dict_metadata[key].properties = dataclasses.replace(props, dtype=torch.bfloat16)
    return rf"'{re.escape(key)}' is \[.*\] torch\.bfloat16, the model has \[.*\] torch\.float32"


def _missing(ckpt: Path, metadata, key: str) -> str:
    del metadata.state_dict_metadata[key]
    return rf"has no entry for '{re.escape(key)}'"


def _extra(ckpt: Path, metadata, key: str) -> str:
    """A second model tensor with its own bytes (a copy appended to the shard): one the model lacks."""
    (index,) = [i for i in metadata.storage_data if i.fqn == key]
    info = metadata.storage_data[index]
    shard = ckpt / info.relative_path
    data = shard.read_bytes()
    shard.write_bytes(data + data[info.offset: info.offset + info.length])
    metadata.state_dict_metadata["state_dict.extra"] = metadata.state_dict_metadata[key]
    metadata.storage_data[dcp_metadata.MetadataIndex("state_dict.extra", index.offset)] = dataclasses.replace(
        info, offset=len(data))
    metadata.planner_data["state_dict.extra"] = ("state_dict", "extra")
    meta = read_meta(ckpt)
    meta["lightning_moe"]["files"][shard.name] = {"size": shard.stat().st_size,
                                                 "sha256": hashlib.sha256(shard.read_bytes()).hexdigest()}
    write_meta(ckpt, meta)
    return r"holds 'state_dict\.extra', which the model does not have"


def _uncovered(ckpt: Path, metadata, key: str) -> str:
    _empty_chunks(metadata, key)
    return rf"the chunks of '{re.escape(key)}' cover 0"


def test_resume_refuses_entries_that_do_not_match_the_model(saved, tmp_path):
    """Library bug: a tensor without chunks kept its fresh initialisation, a bfloat16 entry loaded as
    float32, a key the model lacks was ignored; a missing key failed inside DCP naming no file."""
    cases = []
    for edit in (_uncovered, _bfloat16, _missing, _extra):
        ckpt = shutil.copytree(saved, tmp_path / edit.__name__)
        metadata = read_metadata(ckpt)
        pattern = edit(ckpt, metadata, _largest_tensor(metadata))
        write_metadata(ckpt, metadata)
        cases.append((str(ckpt), pattern))
    before = snapshot(tmp_path)
    assert run_distributed(_resume_cases, 1, cases) == ["ok"]
    assert snapshot(tmp_path) == before


def _resume_and_save(rank: int, world: int, run: str, ckpt: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(world, Path(run), ckpt_path=ckpt, max_epochs=3, ep=1, filename="{epoch}", save_top_k=1, save_last=True)
    return [str(w.message) for w in caught]


def test_resume_deletes_nothing_outside_the_run(saved, tmp_path):
    """Library bug: ModelCheckpoint paths restored from meta.pt (``<dirpath>/../victim``) were rmtree-d at the next save."""
    run = tmp_path / "run"
    ckpt = shutil.copytree(saved, run / CKPT)
    victims = {key: tmp_path / f"victim_{key}" for key in ("best", "last", "k")}
    for victim in victims.values():
        victim.mkdir()
        (victim / "meta.pt").write_bytes(b"precious")
    meta = read_meta(ckpt)
    (state_key,) = [k for k in meta["callbacks"] if k.startswith("ModelCheckpoint")]
    state = meta["callbacks"][state_key]
    state.update(dirpath=str(run), best_model_path=f"{run}/../victim_best", last_model_path=f"{run}/../victim_last",
                 best_k_models={f"{run}/../victim_k": torch.tensor(0.0)}, kth_best_model_path=f"{run}/../victim_k")
    write_meta(ckpt, meta)
    before = snapshot(tmp_path, skip=run)
    (messages,) = run_distributed(_resume_and_save, 1, str(run), str(ckpt))
    assert snapshot(tmp_path, skip=run) == before
    for victim in victims.values():
        assert (victim / "meta.pt").read_bytes() == b"precious", victim
    assert any("names checkpoints outside its folder" in m and "victim_best" in m for m in messages), messages
    assert sorted(os.listdir(run)) == [CKPT, "epoch=2.ckpt", "last.ckpt"]


def test_remove_refuses_paths_outside_the_checkpoint_directory(tmp_path):
    """The second line of defence: MoECheckpointing.remove resolves the path against the callbacks' folders."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    for folder in (run / "epoch=0.ckpt", outside / "victim", run / "foreign"):
        folder.mkdir(parents=True)
        (folder / "meta.pt").write_bytes(b"x")
    (run / "foreign" / "notes.txt").write_text("not a checkpoint file")
    (run / "link").symlink_to(outside)
    before = snapshot(outside)
    checkpointing = MoECheckpointing(strategy=None)
    for path, reason in ((run / ".." / "outside" / "victim", "is not directly in the checkpoint directory"),
                         (run / "link" / "victim", "is not directly in the checkpoint directory"),
                         (run / "foreign", "holds files a lightning_moe checkpoint does not write")):
        with pytest.warns(UserWarning, match=rf"Not removing the checkpoint {re.escape(str(path))}: .*{reason}"):
            assert checkpointing.remove(path, [run]) is False
    assert snapshot(outside) == before and (run / "foreign" / "notes.txt").exists()
    assert checkpointing.remove(run / "epoch=0.ckpt", [run]) is True
    assert sorted(os.listdir(run)) == ["foreign", "link"]


def test_restored_callback_paths_without_a_dirpath_are_dropped(tmp_path):
    """A state that omits ``dirpath`` makes ModelCheckpoint keep its own (and restore every path)."""
    from lightning_moe.strategies.checkpoint_paths import drop_outside_paths

    run = tmp_path / "run"
    inside = {"dirpath": str(run), "best_model_path": str(run / "epoch=0.ckpt"), "last_model_path": "",
              "best_k_models": {str(run / "epoch=0.ckpt"): 0.5}, "kth_best_model_path": str(run / "epoch=0.ckpt")}
    crafted = {"best_model_path": str(tmp_path / "victim"), "last_model_path": str(run / "last.ckpt"),
               "best_k_models": {str(tmp_path / "victim"): 0.1}, "kth_best_model_path": ""}
    meta = {"callbacks": {"ModelCheckpoint{a}": dict(inside), "ModelCheckpoint{b}": crafted}}
    with pytest.warns(UserWarning, match=r"ckpt: the state of ModelCheckpoint\{b\} names checkpoints outside its folder None"):
        drop_outside_paths(meta, tmp_path / "ckpt")
    assert meta["callbacks"]["ModelCheckpoint{a}"] == inside
    assert meta["callbacks"]["ModelCheckpoint{b}"] == {"best_model_path": "", "last_model_path": "", "best_k_models": {},
                                                       "kth_best_model_path": ""}
