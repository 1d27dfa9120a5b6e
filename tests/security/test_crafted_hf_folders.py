"""Crafted Hugging Face model folders: the safetensors index never makes a load read outside the folder.

``model.safetensors.index.json`` maps each tensor to a shard file; a crafted ``weight_map`` with
``../``, an absolute path or a link to a file elsewhere is refused naming the index, the tensor and
the file. A ``huggingface_hub`` cache (``snapshots/<revision>/`` links into the repository's
``blobs/``) still loads. A ``config.json`` declaring absurd sizes, or sizes the safetensors headers
contradict, is refused naming the field before anything is built; a malformed ``tokenizer.json``
is refused naming the file.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from security.crafting import snapshot

pytest.importorskip("safetensors", reason="the hf and test extras install safetensors")
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


# -- declared sizes and malformed files --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE folder (config.json, safetensors, tokenizer.json), copied by each test."""
    pytest.importorskip("transformers", reason="the test extra installs transformers")
    pytest.importorskip("tokenizers", reason="the hf and test extras install tokenizers")
    from helpers.hf import tiny_models

    folder = tmp_path_factory.mktemp("tiny_hf") / "model"
    tiny_models().make_tiny_model(folder, "qwen3_moe", texts=["def f(x):\n    return x\n"] * 4)
    return folder


def _crafted(tiny_folder: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    return folder


@pytest.mark.parametrize(("field", "value", "says"), [
    ("num_hidden_layers", 10**6, r"a sane value lies in \[1, 4096\]"),
    ("num_hidden_layers", 8, r"the weights hold 3 layers \(model\.layers\.0-2\)"),
    ("vocab_size", 10**12, r"a sane value lies in \[1, 16777216\]"),
    ("hidden_size", 0, r"a sane value lies in \[1, \d+\]"),
    ("num_experts", 4096, r"the weights hold \d+ experts per layer"),
    ("moe_intermediate_size", 17, r"the weights' experts are 16 wide"),
    ("vocab_size", 100, r"the weights' model\.embed_tokens\.weight is \[\d+, \d+\]"),
])
def test_absurd_declared_sizes_are_refused_before_building(tiny_folder, tmp_path, field, value, says):
    """Library bug: init_from built the model config.json declares (10^6 layers ran for minutes)."""
    from lightning_moe.lit import MoELanguageModel

    folder = _crafted(tiny_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    before = snapshot(tmp_path)
    pattern = rf"{re.escape(str(folder / 'config.json'))} declares {field}={value}, but {says}; refusing"
    with pytest.raises(ValueError, match=pattern):
        MoELanguageModel(init_from=str(folder))
    assert snapshot(tmp_path) == before


def test_malformed_tokenizer_json_names_the_file(tiny_folder, tmp_path):
    """Library bug: tokenizers' bare 'Exception: expected value at line 1 column 1' named no file."""
    from lightning_moe.data.hf_tokenizer import HFTokenizer

    folder = _crafted(tiny_folder, tmp_path)
    file = folder / "tokenizer.json"
    file.write_text(file.read_text()[: 200])
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=rf"{re.escape(str(file))} is not a valid tokenizer\.json \(.+\)"):
        HFTokenizer(folder)
    assert snapshot(tmp_path) == before
