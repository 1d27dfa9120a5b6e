"""Crafted Hugging Face model folders: the safetensors index never makes a load read outside the folder.

``model.safetensors.index.json`` maps each tensor to a shard file; a crafted ``weight_map`` with
``../``, an absolute path or a link to a file elsewhere is refused naming the index, the tensor and
the file. A ``huggingface_hub`` cache (``snapshots/<revision>/`` links into the repository's
``blobs/``) still loads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from security.crafting import snapshot

pytest.importorskip("safetensors")
from safetensors.torch import save_file

from lightning_moe.models.hf.io import INDEX_NAME, SafetensorsReader

SHARD = "model-00001-of-00001.safetensors"


def _folder(tmp_path: Path, shard_name: str) -> tuple[Path, Path]:
    """A model folder whose index maps ``w`` to ``shard_name``, and a real shard outside it."""
    folder, outside = tmp_path / "model", tmp_path / "outside.safetensors"
    folder.mkdir()
    save_file({"w": torch.arange(4.0)}, outside)
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {"w": shard_name}}))
    return folder, outside


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "link"])
def test_weight_map_outside_the_folder_is_refused(tmp_path, kind):
    """Library bug: the tensor was read from the file outside the model folder."""
    folder, outside = _folder(tmp_path, {"dotdot": "../outside.safetensors", "absolute": "", "link": SHARD}[kind])
    if kind == "absolute":
        (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {"w": str(outside)}}))
    if kind == "link":
        (folder / SHARD).symlink_to(outside)
    before = snapshot(tmp_path)
    pattern = rf"{re.escape(str(folder / INDEX_NAME))} maps w to .*(not a file name in|symbolic link to).*refusing"
    with pytest.raises(ValueError, match=pattern), SafetensorsReader(folder) as reader:
        reader.get("w")
    assert snapshot(tmp_path) == before


def test_hub_cache_links_into_blobs_still_load(tmp_path):
    """huggingface_hub's cache: snapshots/<rev>/<file> are links to ../../blobs/<hash>."""
    repo = tmp_path / "models--org--name"
    snapshot_dir, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot_dir.mkdir(parents=True)
    blobs.mkdir()
    save_file({"w": torch.arange(4.0)}, blobs / "0f1e")
    (snapshot_dir / SHARD).symlink_to(Path("..") / ".." / "blobs" / "0f1e")
    (snapshot_dir / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {"w": SHARD}}))
    with SafetensorsReader(snapshot_dir) as reader:
        torch.testing.assert_close(reader.get("w"), torch.arange(4.0), rtol=0, atol=0)
