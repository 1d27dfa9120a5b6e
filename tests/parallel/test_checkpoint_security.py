"""Loading a checkpoint never runs code: crafted DCP metadata and bytes items are refused.

Each test crafts the file an attacker would ship, with a harmless payload (creating a marker
directory), and checks that loading raises a clear error and that the marker does not exist. The
three ways found in the trial:

* ``.metadata`` naming an allowed module with a dotted attribute
  (``torch.distributed.checkpoint.filesystem`` + ``os.makedirs``): the old allowlist admitted any
  name under a module prefix, and protocol 4 resolves dotted names;
* ``.metadata`` calling a function of an allowed module that itself unpickles a file
  (``torch.distributed.checkpoint.format_utils.torch_save_to_dcp``);
* ``.metadata`` re-declaring a tensor key as a bytes item that points at a pickle appended to a
  shard: DCP's default planner reads bytes items with ``torch.load(weights_only=False)``.

Plus: the unpickler must not let a file set attributes on an allowed class (pickle's BUILD opcode
on a class object), and the allowlist reads every layout DCP writes for us (the resume and reshard
tests load real checkpoints through it too). No process group: DCP runs in its no-dist mode.
"""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from strategies.checkpoint_runs import MakeDir, redeclare_as_bytes_item
from torch.distributed.checkpoint.api import CheckpointException

from lightning_moe.checkpoint.sharded import SafeFileSystemReader, load_sharded

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _global_call(module: str, name: str, *args) -> bytes:
    """A protocol-4 pickle that calls ``module.name(*args)`` (GLOBAL + REDUCE), written opcode by opcode
    so that ``name`` may be dotted, as an attacker would write it."""
    arguments = pickle.dumps(args, protocol=2)[2:-1]  # the tuple's opcodes, without PROTO and STOP
    return b"\x80\x04" + b"c" + f"{module}\n{name}\n".encode() + arguments + b"R."


def _write_metadata(ckpt: Path, payload: bytes) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / ".metadata").write_bytes(payload)


@pytest.mark.parametrize(
    ("name", "args"),
    [("os.makedirs", ("{marker}",)), ("os.system", ("mkdir {marker}",))],
    ids=["os.makedirs", "os.system"],
)
def test_dotted_name_under_an_allowed_module_is_refused(tmp_path, name, args):
    marker = tmp_path / "marker"
    args = tuple(a.format(marker=marker) for a in args)
    _write_metadata(tmp_path / "ckpt", _global_call("torch.distributed.checkpoint.filesystem", name, *args))
    with pytest.raises(pickle.UnpicklingError, match=rf"Refusing to load torch\.distributed\.checkpoint\.filesystem\.{name}"):
        SafeFileSystemReader(tmp_path / "ckpt").read_metadata()
    assert not marker.exists(), "the crafted .metadata ran code"


def test_function_of_an_allowed_module_that_unpickles_is_refused(tmp_path):
    marker = tmp_path / "marker"
    payload = tmp_path / "payload.pt"
    torch.save(MakeDir(marker), payload)  # what torch_save_to_dcp would torch.load(weights_only=False)
    _write_metadata(
        tmp_path / "ckpt",
        _global_call("torch.distributed.checkpoint.format_utils", "torch_save_to_dcp", str(payload), str(tmp_path / "out")),
    )
    with pytest.raises(pickle.UnpicklingError, match=r"Refusing to load torch\.distributed\.checkpoint\.format_utils\.torch_save_to_dcp"):
        SafeFileSystemReader(tmp_path / "ckpt").read_metadata()
    assert not marker.exists(), "the crafted .metadata ran code"


def test_attributes_of_an_allowed_class_cannot_be_set(tmp_path):
    """BUILD on a class object (state ``(None, {...})``) would set class attributes process-wide."""
    # GLOBAL pathlib PosixPath; state (None, {"lightning_moe_marker": 1}); BUILD; STOP.
    payload = b"\x80\x04cpathlib\nPosixPath\n" + pickle.dumps((None, {"lightning_moe_marker": 1}), protocol=2)[2:-1] + b"b."
    _write_metadata(tmp_path / "ckpt", payload)
    try:
        with pytest.raises(pickle.UnpicklingError, match=r"Refusing to set the state of pathlib\.PosixPath"):
            SafeFileSystemReader(tmp_path / "ckpt").read_metadata()
        assert not hasattr(pathlib.PosixPath, "lightning_moe_marker")
    finally:
        if hasattr(pathlib.PosixPath, "lightning_moe_marker"):
            del pathlib.PosixPath.lightning_moe_marker


def _checkpoint_with_bytes_item(tmp_path: Path, key: str) -> tuple[Path, Path]:
    """A real DCP checkpoint whose tensor ``key`` is re-declared as a bytes item pointing at a
    pickle appended to its shard. Returns (checkpoint, marker)."""
    ckpt, marker = tmp_path / "ckpt", tmp_path / "marker"
    dcp.save({key: torch.arange(16.0), "other": torch.ones(3)}, checkpoint_id=ckpt)
    redeclare_as_bytes_item(ckpt, key, MakeDir(marker))
    return ckpt, marker


def test_bytes_item_in_place_of_a_tensor_is_refused_by_the_reader(tmp_path):
    """``dcp.load`` with `SafeFileSystemReader` (and DCP's default planner) refuses the bytes item."""
    ckpt, marker = _checkpoint_with_bytes_item(tmp_path, "w")
    state = {"w": torch.zeros(16), "other": torch.zeros(3)}
    with pytest.raises(CheckpointException, match=r"declares 'w' as a pickled \(bytes\) item"):
        dcp.load(state, storage_reader=SafeFileSystemReader(ckpt))
    assert not marker.exists(), "the crafted bytes item ran code"


def test_bytes_item_in_place_of_a_tensor_is_refused_by_load_sharded(tmp_path):
    ckpt, marker = _checkpoint_with_bytes_item(tmp_path, "w")
    state = {"w": torch.zeros(16), "other": torch.zeros(3)}
    with pytest.raises(pickle.UnpicklingError, match=rf"{ckpt}.*declares 'w' as a pickled \(bytes\) item.*holds a tensor"):
        load_sharded(state, ckpt)
    assert not marker.exists(), "the crafted bytes item ran code"


def test_storage_file_outside_the_checkpoint_is_refused(tmp_path):
    """``.metadata`` naming ``../outside.distcp`` as an item's file would make DCP read outside the folder."""
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=ckpt)
    with open(ckpt / ".metadata", "rb") as file:
        metadata = pickle.load(file)  # our own file, just written: trusted
    (index,) = metadata.storage_data
    info = metadata.storage_data[index]
    shutil.copy(ckpt / info.relative_path, tmp_path / "outside.distcp")  # a readable file is there
    metadata.storage_data[index] = dataclasses.replace(info, relative_path="../outside.distcp")
    with open(ckpt / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    pattern = rf"{re.escape(str(ckpt / '.metadata'))} names the storage file '\.\./outside\.distcp', which is not a file inside"
    with pytest.raises(pickle.UnpicklingError, match=pattern):
        load_sharded({"w": torch.zeros(4)}, ckpt)
    with pytest.raises(CheckpointException, match=pattern):
        dcp.load({"w": torch.zeros(4)}, storage_reader=SafeFileSystemReader(ckpt))


def test_declared_non_tensor_values_load_with_weights_only(tmp_path):
    """A value the template itself declares as non-tensor loads, but only through ``weights_only``."""
    dcp.save({"w": torch.arange(4.0), "note": "epoch 3"}, checkpoint_id=tmp_path / "plain")
    state = {"w": torch.zeros(4), "note": ""}
    load_sharded(state, tmp_path / "plain")
    torch.testing.assert_close(state["w"], torch.arange(4.0), rtol=0, atol=0)
    assert state["note"] == "epoch 3"

    marker = tmp_path / "marker"
    dcp.save({"w": torch.arange(4.0), "note": MakeDir(marker)}, checkpoint_id=tmp_path / "code")
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError, match=r"(?s)bytes item 'note' holds objects other than tensors.*os\.makedirs"):
        load_sharded({"w": torch.zeros(4), "note": ""}, tmp_path / "code")
    assert not marker.exists(), "a declared bytes item ran code"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_metadata_dcp_writes_reads_back(tmp_path, dtype):
    """The exact allowlist reads what DCP writes for every dtype we save (and a 0-d step tensor)."""
    saved = {"w": torch.arange(12).reshape(3, 4).to(dtype), "step": torch.tensor(7.0)}
    dcp.save(saved, checkpoint_id=tmp_path)
    state = {k: torch.zeros_like(v) for k, v in saved.items()}
    load_sharded(state, tmp_path)
    for key, value in saved.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)
        assert state[key].dtype == value.dtype


@pytest.mark.gpu
def test_cuda_bf16_round_trip(tmp_path):
    """On the GPU image's torch: the allowlist reads CUDA bf16 checkpoints, loading into CUDA tensors."""
    saved = {"w": torch.randn(8, 16, device="cuda").to(torch.bfloat16), "b": torch.randn(16, device="cuda")}
    dcp.save(saved, checkpoint_id=tmp_path)
    state = {k: torch.zeros_like(v) for k, v in saved.items()}
    load_sharded(state, tmp_path)
    for key, value in saved.items():
        assert state[key].device.type == "cuda" and state[key].dtype == value.dtype, key
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)
