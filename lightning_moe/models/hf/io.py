"""Files of a Hugging Face model directory: ``config.json`` and safetensors weights, sharded or not.

The layout ``transformers`` reads and writes: one ``model.safetensors``, or shards
``model-00001-of-0000N.safetensors`` listed by ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file}}``). safetensors is
an optional dependency (the ``hf`` extra), imported when a file is read or written.

Model folders come from others, so the index is not trusted to name files: every shard it lists
must be a plain file name in the folder (no ``..``, no absolute path, no subfolder), and a
symbolic link only resolves into the folder or, in a ``huggingface_hub`` cache
(``<repo>/snapshots/<revision>/``), into that repository's ``blobs/`` (:func:`weight_file`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_moe.install_hints import install_hint

__all__ = [
    "CONFIG_NAME",
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "SafetensorsReader",
    "parse_size",
    "read_config",
    "weight_file",
    "write_config",
    "write_safetensors",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def _safetensors():
    """The safetensors modules, or an ImportError that names the extra to install."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError as error:
        raise ImportError(
            "Reading or writing Hugging Face model directories needs the safetensors package: "
            f"{install_hint('hf')}."
        ) from error
    return safetensors


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string such as ``"5GB"``, ``"500MB"``, ``"2GiB"`` (as transformers)."""
    if isinstance(size, int):
        if size < 1:
            raise ValueError(f"max_shard_size must be >= 1 byte, got {size}.")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
    if match is None:
        raise ValueError(
            f"Cannot read the size {size!r}; give bytes as an int or a string like '5GB' or '500MB'."
        )
    return max(1, int(float(match.group(1)) * _UNITS[match.group(2) or ""]))


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of the model directory ``path`` as a dict."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist: {path} is not a Hugging Face model directory.")
    try:
        with open(file, encoding="utf-8") as handle:
            config = json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file} is not a valid config.json: {err}.") from err
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a valid config.json: it holds a {type(config).__name__}, not a mapping.")
    return config


def write_config(config: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write ``config`` as ``path/config.json`` (sorted keys, indented, as ``transformers``)."""
    with open(Path(path) / CONFIG_NAME, "w", encoding="utf-8") as handle:
        json.dump(dict(config), handle, indent=2, sort_keys=True)
        handle.write("\n")


def weight_file(folder: Path, name: object, key: str) -> Path:
    """The weight file ``name`` that the index of ``folder`` lists for the tensor ``key`` (``""``: the
    single weights file), checked.

    Raises ``ValueError`` naming the index, the tensor and the file when ``name`` is not a plain
    file name, or is a link that resolves outside the folder (and outside its hub cache's blobs).
    """
    where = f"{folder / INDEX_NAME} maps {key} to {name!r}" if key else f"{folder / str(name)} is named"
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"{where}, which is not a file name in {folder}; refusing to read weights outside the model folder.")
    path = folder / name
    if path.is_symlink():
        root = folder.resolve()
        target = path.resolve()
        allowed = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
        if not any(target.parent == place or place in target.parents for place in allowed):
            raise ValueError(f"{where}, a symbolic link to {target} outside the model folder; refusing to read it.")
    return path


class SafetensorsReader:
    """The tensors of a model directory by name, read lazily from one file or from indexed shards.

    Use as a context manager (it closes its file handles on exit). :meth:`get` reads one whole
    tensor; :meth:`get_slice` gives safetensors' slice object, which reads only the rows indexed.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._safetensors = _safetensors()
        index, single = self.path / INDEX_NAME, self.path / WEIGHTS_NAME
        if index.is_file():
            with open(index, encoding="utf-8") as handle:
                self.weight_map: dict[str, str] = dict(json.load(handle)["weight_map"])
            checked: set[str] = set()
            for key, name in self.weight_map.items():
                if not isinstance(name, str) or name not in checked:  # each file once: lstat per shard, not per tensor
                    weight_file(self.path, name, key)
                    checked.add(name)
        elif single.is_file():
            weight_file(self.path, WEIGHTS_NAME, "")
            with self._safetensors.safe_open(single, framework="pt") as handle:
                self.weight_map = dict.fromkeys(handle.keys(), WEIGHTS_NAME)
        else:
            raise FileNotFoundError(
                f"{self.path} has no {INDEX_NAME} or {WEIGHTS_NAME}: the weights of a Hugging Face model "
                "directory must be safetensors files (convert .bin checkpoints with transformers first)."
            )
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close every open shard."""
        self._stack.close()
        self._handles.clear()

    def keys(self) -> list[str]:
        """Every tensor name in the directory."""
        return list(self.weight_map)

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def __iter__(self) -> Iterator[str]:
        return iter(self.weight_map)

    def _handle(self, key: str):
        if key not in self.weight_map:
            raise KeyError(
                f"tensor {key} is not in {self.path} (the checkpoint does not match its config.json, or it "
                "belongs to another model family)."
            )
        file = self.weight_map[key]
        if file not in self._handles:  # every listed file was checked by weight_file in __init__
            if not (self.path / file).is_file():
                raise FileNotFoundError(
                    f"{self.path / file}, listed in {INDEX_NAME} for {key}, does not exist."
                )
            self._handles[file] = self._stack.enter_context(
                self._safetensors.safe_open(self.path / file, framework="pt")
            )
        return self._handles[file]

    def get(self, key: str) -> Tensor:
        """The tensor ``key`` (in its stored dtype, on the CPU)."""
        return self._handle(key).get_tensor(key)

    def get_slice(self, key: str):
        """safetensors' lazy slice of ``key`` (``[rows]`` reads only those rows)."""
        return self._handle(key).get_slice(key)


def _shards(tensors: Mapping[str, Tensor], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def write_safetensors(
    tensors: Mapping[str, Tensor], path: str | os.PathLike, max_shard_size: int | str
) -> None:
    """Write ``tensors`` into the directory ``path`` as ``transformers`` lays them out.

    One ``model.safetensors`` when they fit in ``max_shard_size``, else shards in the given key
    order with an index (a tensor larger than the limit gets a shard of its own). Weight files
    of an earlier save in ``path`` are removed first, so no stale shard stays listed.
    """
    safetensors = _safetensors()
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.iterdir():
        if old.name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_PATTERN.fullmatch(old.name):
            old.unlink()
    shards = _shards(tensors, parse_size(max_shard_size))
    names = [WEIGHTS_NAME] if len(shards) == 1 else [
        f"model-{number:05d}-of-{len(shards):05d}.safetensors" for number in range(1, len(shards) + 1)
    ]
    weight_map = {}
    for name, keys in zip(names, shards):
        # Own contiguous CPU copies, one shard at a time: safetensors refuses views that share
        # storage (the experts' slices of one stacked tensor).
        owned = {
            key: tensors[key].detach().to("cpu").clone(memory_format=torch.contiguous_format) for key in keys
        }
        safetensors.torch.save_file(owned, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    if len(shards) == 1:
        return
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(directory / INDEX_NAME, "w", encoding="utf-8") as handle:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        json.dump(index, handle, indent=2, sort_keys=True)
        handle.write("\n")
