"""Files of a Hugging Face model directory: ``config.json`` and safetensors weights, sharded or not.

The layout ``transformers`` reads and writes: one ``model.safetensors``, or shards
``model-00001-of-0000N.safetensors`` listed by ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file}}``). safetensors is
an optional dependency (the ``hf`` extra), imported when a file is read. Files are written here,
tensor by tensor, in safetensors' format (a length-prefixed JSON header of names, dtypes, shapes
and byte ranges, then the raw little-endian data): the library's writer needs every tensor of a
file in memory at once (and copies each into a bytes object), which an export of a large model
cannot afford.

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
import struct
import sys
from collections.abc import Callable, Iterator, Mapping
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
    "TensorSpec",
    "parse_size",
    "read_config",
    "weight_file",
    "write_config",
    "write_safetensors",
    "write_safetensors_lazily",
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


_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
"""safetensors' names of the dtypes it stores."""
_HEADER_ALIGNMENT = 8
"""safetensors pads its JSON header with spaces so the data starts at a multiple of 8 bytes."""

TensorSpec = tuple[torch.Size, torch.dtype]
"""A tensor's shape and dtype, known before its data is read."""


def _nbytes(spec: TensorSpec) -> int:
    return spec[0].numel() * spec[1].itemsize


def _shards(specs: Mapping[str, TensorSpec], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for key, spec in specs.items():
        nbytes = _nbytes(spec)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _header(keys: list[str], specs: Mapping[str, TensorSpec]) -> bytes:
    """The length-prefixed JSON header of a safetensors file holding ``keys`` in that order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in keys:
        shape, dtype = specs[key]
        if dtype not in _DTYPE_NAMES:
            raise ValueError(
                f"{key}: safetensors cannot store {dtype}; it stores {', '.join(str(d) for d in _DTYPE_NAMES)}: "
                "cast the tensor to one of them first."
            )
        header[key] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + _nbytes(specs[key])]}
        offset += _nbytes(specs[key])
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _HEADER_ALIGNMENT)
    return struct.pack("<Q", len(text)) + text


def _write_data(file, key: str, tensor: Tensor, spec: TensorSpec) -> None:
    if tuple(tensor.shape) != tuple(spec[0]) or tensor.dtype != spec[1]:
        raise ValueError(f"{key}: the tensor is {list(tensor.shape)} {tensor.dtype}, but {list(spec[0])} {spec[1]} was declared.")
    data = tensor.detach().to("cpu").contiguous()  # a copy only if it is not already a contiguous CPU tensor
    file.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))


def write_safetensors_lazily(
    specs: Mapping[str, TensorSpec], get: Callable[[str], Tensor], path: str | os.PathLike, max_shard_size: int | str
) -> int:
    """Write the tensors named by ``specs`` into the directory ``path`` as ``transformers`` lays them out,
    reading each through ``get(name)`` only when it is written; returns their total bytes.

    One ``model.safetensors`` when they fit in ``max_shard_size``, else shards
    ``model-0000i-of-0000N.safetensors`` in the order of ``specs`` with the index
    ``model.safetensors.index.json`` (a tensor larger than the limit gets a shard of its own), as
    ``save_pretrained(max_shard_size=...)`` does. Each file's header is written first, from the
    shapes and dtypes of ``specs``, then each tensor's bytes as ``get`` returns it, so no shard is
    ever held in memory: only the tensor ``get`` returns (and a contiguous copy of it when it is
    not a contiguous CPU tensor). Within a file the tensors are laid out by decreasing dtype size,
    as safetensors does, so each one's data is aligned to its dtype. Weight files of an earlier
    save in ``path`` are removed first, so no stale shard stays listed.
    """
    if sys.byteorder != "little":
        raise RuntimeError("safetensors files are little-endian; writing them on a big-endian machine is not supported.")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.iterdir():
        if old.name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_PATTERN.fullmatch(old.name):
            old.unlink()
    shards = _shards(specs, parse_size(max_shard_size))
    names = [WEIGHTS_NAME] if len(shards) == 1 else [
        f"model-{number:05d}-of-{len(shards):05d}.safetensors" for number in range(1, len(shards) + 1)
    ]
    weight_map = {}
    for name, keys in zip(names, shards):
        keys = sorted(keys, key=lambda k: -specs[k][1].itemsize)  # stable: the given order within a dtype size
        with open(directory / name, "wb") as file:
            file.write(_header(keys, specs))
            for key in keys:
                _write_data(file, key, get(key), specs[key])
            file.flush()
            os.fsync(file.fileno())
        weight_map.update(dict.fromkeys(keys, name))
    total = sum(_nbytes(spec) for spec in specs.values())
    if len(shards) > 1:
        with open(directory / INDEX_NAME, "w", encoding="utf-8") as handle:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            json.dump(index, handle, indent=2, sort_keys=True)
            handle.write("\n")
    return total


def write_safetensors(
    tensors: Mapping[str, Tensor], path: str | os.PathLike, max_shard_size: int | str
) -> None:
    """Write ``tensors`` into the directory ``path`` as ``transformers`` lays them out
    (:func:`write_safetensors_lazily`, each tensor written from where it is, never a shard's copy)."""
    specs = {key: (tensor.shape, tensor.dtype) for key, tensor in tensors.items()}
    write_safetensors_lazily(specs, tensors.__getitem__, path, max_shard_size)
