"""Loading a checkpoint reads tensors and DCP's bookkeeping, and never runs code from the files.

The three ways a crafted checkpoint could run code, and what closes each:

* DCP's ``.metadata`` is a pickle. :class:`RestrictedUnpickler` resolves only the exact
  ``(module, name)`` pairs of :data:`_ALLOWED_GLOBALS` (the classes found in the metadata of real
  checkpoints of every layout the tests save, plus torch dtypes/layouts/memory formats by value):
  never a dotted name, never a module prefix, no function that could itself unpickle a file. It
  lets pickle's BUILD opcode set the state of instances of those classes only, and never of an
  enum member (members are shared by the whole process: a BUILD on the memory-format member would
  break every later save), so a file cannot set attributes on a class or a shared object either.
  The EXT opcodes (copyreg's extension registry, whose cache bypasses ``find_class``) are refused.
  In a sharded checkpoint of this package, ``.metadata`` is checked against the size and digest
  recorded in ``meta.pt`` before it is unpickled, and ``meta.pt`` against its own record
  (:data:`~lightning_moe.checkpoint.integrity.META_DIGEST_FILE`).
* A bytes item (a pickled value inside a shard) is unpickled only for a key whose value in the
  caller's own state dict is not a tensor, and then with ``torch.load(weights_only=True)``
  (:class:`SafeLoadPlanner`; DCP's default planner uses ``weights_only=False``). Our checkpoints
  hold tensors only, so a bytes item where the model has a tensor means the file was altered.
  :class:`SafeFileSystemReader` refuses bytes items under any other planner.
* ``torch.save`` files (``meta.pt``, consolidated checkpoints) load through
  :func:`load_torch_file`: ``weights_only`` unless the caller says the file is trusted.

:func:`load_sharded` is how this package loads a DCP directory: every load path (resume,
reshard, one-device loads of a sharded checkpoint) goes through it; resume and export open a
sharded checkpoint's ``meta.pt`` and ``.metadata`` with :func:`read_sharded_metadata` first.
"""

from __future__ import annotations

import enum
import io
import pathlib
import pickle
import weakref
import zipfile
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as _dcp_filesystem
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType

from lightning_moe.checkpoint.entries import check_storage
from lightning_moe.checkpoint.files import rank_failures
from lightning_moe.checkpoint.integrity import (
    DCP_METADATA,
    LAYOUT_KEY,
    META_FILE,
    CheckpointIntegrityError,
    check_bytes,
    check_complete,
    read_member,
    read_meta_digest,
)
from lightning_moe.checkpoint.legacy import adopt_legacy_fc1
from lightning_moe.compat import layout_lookup_global, set_element

__all__ = [
    "RestrictedUnpickler",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnsafeCheckpointError",
    "is_mappable",
    "load_sharded",
    "load_torch_file",
    "parse_dcp_metadata",
    "read_dcp_metadata",
    "read_sharded_metadata",
]

# The classes DCP pickles into .metadata (recorded from the checkpoints of every layout the tests
# save: plain, EP/ETP-sharded DTensors, optimizer states; torch 2.11-2.13). Looked up by name so a
# torch without one of them still imports.
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
}
_MODULES = {"torch.distributed.checkpoint.metadata": _dcp_metadata, "torch.distributed.checkpoint.filesystem": _dcp_filesystem}
_DCP_OBJECTS: dict[tuple[str, str], type] = {
    (module, name): getattr(_MODULES[module], name)
    for module, names in _DCP_CLASSES.items() for name in names if hasattr(_MODULES[module], name)
}
_BUILDABLE: frozenset[type] = frozenset(_DCP_OBJECTS.values())
"""Classes whose instances BUILD may set the state of (DCP's metadata dataclasses)."""

_LAYOUT_GLOBAL, _LAYOUT_LOOKUP = layout_lookup_global()
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **_DCP_OBJECTS,
    # StorageMeta.checkpoint_id: FileSystemWriter stores the path (Python 3.13 names the module pathlib._local).
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "WindowsPath"): pathlib.WindowsPath,
    ("pathlib._local", "PosixPath"): pathlib.PosixPath,
    ("pathlib._local", "WindowsPath"): pathlib.WindowsPath,
    ("torch", "Size"): torch.Size,
    # TensorProperties.layout: a lookup of torch's layout objects by their string.
    _LAYOUT_GLOBAL: _LAYOUT_LOOKUP,
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint holds something that loading it would have to execute or unpickle unsafely."""


def _describe(obj: Any) -> str:
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    return f"an instance of {type(obj).__module__}.{type(obj).__qualname__}"


class RestrictedUnpickler(pickle._Unpickler):
    """Unpickles DCP metadata: exact allowlisted globals only, and BUILD only on their instances.

    Python's pure unpickler (not the C one): its opcode table can be extended, which BUILD needs.
    ``source`` names the file in errors.
    """

    dispatch: ClassVar[dict] = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        """The allowlisted object named ``module.name``; anything else raises :class:`UnsafeCheckpointError`."""
        obj = _ALLOWED_GLOBALS.get((module, name))
        if obj is None and module == "torch" and "." not in name:
            value = getattr(torch, name, None)
            obj = value if isinstance(value, _TORCH_VALUES) else None
        if obj is None:
            raise UnsafeCheckpointError(
                f"Refusing to load {module}.{name} from {self.source}: a checkpoint's metadata may only hold "
                "torch.distributed.checkpoint's metadata classes, torch dtypes and paths. The file was "
                "crafted or altered, or written by code other than torch.distributed.checkpoint."
            )
        return obj

    def _load_build(self) -> None:
        target = self.stack[-2]  # BUILD pops the state and applies it to the object below it
        if type(target) not in _BUILDABLE or isinstance(target, enum.Enum):
            raise UnsafeCheckpointError(
                f"Refusing to set the state of {_describe(target)} from {self.source}: only new instances of "
                "torch.distributed.checkpoint's metadata classes take a state from a checkpoint (never an enum "
                "member, a class or any other object shared by the process)."
            )
        pickle._Unpickler.load_build(self)

    def _load_ext(self) -> None:
        # copyreg's extension codes resolve globals from a process-wide cache, past find_class.
        raise UnsafeCheckpointError(
            f"Refusing the pickle extension-registry opcode (EXT1/EXT2/EXT4) in {self.source}: DCP never writes it."
        )

    dispatch[pickle.BUILD[0]] = _load_build
    for _opcode in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_opcode[0]] = _load_ext
    del _opcode


def read_dcp_metadata(path: Path | str) -> _dcp_metadata.Metadata:
    """Read DCP's ``.metadata`` file ``path`` with :class:`RestrictedUnpickler`; errors name the file."""
    path = Path(path)
    return parse_dcp_metadata(path.read_bytes(), path)  # FileNotFoundError names the path


def parse_dcp_metadata(data: bytes, path: Path | str) -> _dcp_metadata.Metadata:
    """DCP's metadata from the bytes ``data`` of the file ``path`` (named in errors), with the allowlist."""
    try:
        metadata = RestrictedUnpickler(io.BytesIO(data), str(path)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # EOFError, UnpicklingError, ... from a truncated or damaged file
        raise CheckpointIntegrityError(
            f"{path} cannot be read ({type(err).__name__}: {err}): the file is truncated or corrupt."
        ) from err
    if not isinstance(metadata, _dcp_metadata.Metadata):
        raise CheckpointIntegrityError(f"{path} holds a {type(metadata).__name__}, not DCP's checkpoint metadata.")
    return metadata


_PATHS_CHECKED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
"""Metadata whose storage paths were checked, by ``id`` (an export loads a few tensors at a time)."""


def _check_storage_paths(metadata: _dcp_metadata.Metadata, source: str) -> None:
    # Every item must live in a file of the checkpoint directory itself ("../x" would read elsewhere).
    if _PATHS_CHECKED.get(id(metadata)) is metadata:
        return
    checked: set[str] = set()
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if isinstance(name, str) and name in checked:
            continue
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise UnsafeCheckpointError(f"{source} names the storage file {name!r}, which is not a file inside the checkpoint.")
        checked.add(name)
    _PATHS_CHECKED[id(metadata)] = metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except for bytes (pickled) items.

    A bytes item is read only where the state dict being loaded holds a non-tensor value (it
    declared one), and with ``torch.load(weights_only=True)``. ``source`` names the checkpoint.
    """

    def __init__(self, source: Path | str = "the checkpoint", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.source = str(source)

    def create_local_plan(self):
        """DCP's plan; raises :class:`UnsafeCheckpointError` for a bytes item where the state holds a tensor."""
        plan = super().create_local_plan()
        for item in plan.items:
            fqn = item.dest_index.fqn
            if item.type == LoadItemType.BYTE_IO and isinstance(self.state_dict.get(fqn), Tensor):
                raise UnsafeCheckpointError(
                    f"{self.source}: the checkpoint declares {fqn!r} as a pickled (bytes) item, but the state "
                    "dict being loaded holds a tensor there; refusing to unpickle it. Checkpoints of "
                    "lightning_moe store tensors only: this one was altered or written by other code."
                )
        return plan

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """Unpickle a declared non-tensor value with ``weights_only=True`` and put it in the state dict."""
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(
                f"{self.source}: the bytes item {fqn!r} holds objects other than tensors and plain containers; "
                f"refusing to unpickle them: {err}"
            ) from err
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that reads ``.metadata`` with :class:`RestrictedUnpickler`.

    It also refuses storage files outside the checkpoint directory, and bytes items unless the
    planner is a :class:`SafeLoadPlanner`. ``metadata``: already read (and checked) metadata of
    this checkpoint, used instead of reading the file again.
    """

    def __init__(self, path: Path | str, *, metadata: _dcp_metadata.Metadata | None = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._metadata = metadata

    def reset(self, checkpoint_id: Path | str | None = None) -> None:
        """DCP's reset; a new ``checkpoint_id`` drops the metadata given at construction."""
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> _dcp_metadata.Metadata:
        """The checkpoint's metadata (global, or ``rank``'s own file), read with the allowlist."""
        rank = kwargs.get("rank")
        if self._metadata is not None and rank is None:
            metadata = self._metadata
        else:
            metadata = read_dcp_metadata(self._get_metadata_path(rank))
        # Mirror FileSystemReader.read_metadata's bookkeeping.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = _dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: _dcp_metadata.Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """DCP's set-up, after checking that every storage file is inside the checkpoint directory."""
        _check_storage_paths(metadata, str(Path(self.path) / DCP_METADATA))
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_data(self, plan, planner):
        """Read the planned items; bytes items only under a :class:`SafeLoadPlanner`."""
        if not isinstance(planner, SafeLoadPlanner):
            for item in plan.items:
                if item.type == LoadItemType.BYTE_IO:
                    raise UnsafeCheckpointError(
                        f"{self.path}: the checkpoint declares {item.dest_index.fqn!r} as a pickled (bytes) item, "
                        f"which {type(planner).__name__} would unpickle with weights_only=False; refusing. "
                        "Load with lightning_moe.checkpoint.sharded.load_sharded (or planner=SafeLoadPlanner())."
                    )
        return super().read_data(plan, planner)


# Errors that name the file and the cause: raised as they are, not wrapped in a RuntimeError.
_NAMED_FAILURES = (UnsafeCheckpointError, CheckpointIntegrityError, FileNotFoundError)


def _first_failure(err: CheckpointException) -> BaseException | None:
    failures = list(rank_failures(err).values())
    for kind in _NAMED_FAILURES:
        for failure in failures:
            if isinstance(failure, kind):
                return failure
    return failures[0] if failures else None


def load_sharded(
    state_dict: dict[str, Any],
    path: Path | str,
    *,
    metadata: _dcp_metadata.Metadata | None = None,
    process_group: Any | None = None,
) -> None:
    """Load the DCP checkpoint directory ``path`` into ``state_dict`` in place, safely.

    ``dcp.load`` with :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner`; on every rank
    of ``process_group`` (or without a process group, on one device), at any layout: the
    templates in ``state_dict`` decide what each rank reads. ``metadata``: ``.metadata`` already
    read with :func:`read_dcp_metadata`. DCP's ``CheckpointException`` (a ``BaseException``) is
    turned into the error of the rank that failed (same on every rank). A checkpoint of the older
    gated-fc1 layout ``[E, 2F, H]`` is read into templates of that layout, which replace the
    ``[E, 2, F, H]`` ones in ``state_dict``
    (:func:`~lightning_moe.checkpoint.legacy.adopt_legacy_fc1`); ``load_state_dict``
    accepts both.
    """
    path = Path(path)
    if metadata is None:
        metadata = read_dcp_metadata(path / DCP_METADATA)
    adopt_legacy_fc1(state_dict, metadata)
    # The reader checks the storage paths (on every rank, inside DCP's collective steps).
    reader = SafeFileSystemReader(path, metadata=metadata)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(path), process_group=process_group)
    except CheckpointException as err:
        failure = _first_failure(err)
        if isinstance(failure, _NAMED_FAILURES):
            raise failure from err
        raise RuntimeError(f"Loading the checkpoint {path} failed: {type(failure).__name__}: {failure}") from err


def is_mappable(path: Path | str) -> bool:
    """Whether ``torch.load(path, mmap=True)`` can map the file: ``torch.save``'s zip format (not the
    legacy format of ``_use_new_zipfile_serialization=False``)."""
    return zipfile.is_zipfile(path)


def load_torch_file(path: Path | str, weights_only: bool = True, data: bytes | None = None, mmap: bool = False) -> Any:
    """``torch.load(path)`` on the CPU; errors name the file.

    ``weights_only=True`` (the default) admits tensors and plain containers only and raises
    :class:`UnsafeCheckpointError` otherwise; pass False only for files you trust. ``data``: the
    file's bytes, already read (and checked), parsed instead of reading the file again. ``mmap``:
    map the file instead of reading it (``torch.load(mmap=True)``): the tensors are views of the
    mapping, read from disk page by page as they are used, and nothing is copied into memory (a
    file of torch's legacy format, which cannot be mapped, is read).
    """
    path = Path(path)
    if data is None and not path.is_file():
        raise FileNotFoundError(2, f"{path} does not exist or is not a file")
    try:
        if data is not None:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap and is_mappable(path))
    except pickle.UnpicklingError as err:
        if not weights_only:
            raise CheckpointIntegrityError(f"{path} cannot be read ({type(err).__name__}: {err}).") from err
        raise UnsafeCheckpointError(
            f"{path} holds objects other than tensors and plain containers (or is corrupt); refusing to "
            f"unpickle them: {err}"
        ) from err
    except Exception as err:  # the zip reader's RuntimeError, OSError(EINVAL), EOFError, ...
        raise CheckpointIntegrityError(
            f"{path} cannot be read ({type(err).__name__}: {err}): the file is truncated or corrupt."
        ) from err


def read_sharded_metadata(
    path: Path, weights_only: bool = True, verify: bool = True
) -> tuple[Any, _dcp_metadata.Metadata]:
    """``(meta.pt, .metadata)`` of the sharded checkpoint directory ``path``, checked before use.

    Each file is read once into memory, checked, then parsed from those bytes: ``meta.pt`` against
    :data:`~lightning_moe.checkpoint.integrity.META_DIGEST_FILE`
    (size, and digest if ``verify``), then loaded with
    :func:`load_torch_file` (``weights_only`` unless the caller trusts the file); ``.metadata``
    against its record in ``meta.pt``, then unpickled with the allowlist. Then
    :func:`~lightning_moe.checkpoint.integrity.check_complete` raises naming the first
    missing, truncated, foreign or linked file, and
    :func:`~lightning_moe.checkpoint.entries.check_storage` for entries that do not cover
    their tensors or ask for more bytes than the files hold. Both files must exist (callers say
    which is missing).
    """
    meta_bytes = read_member(path, META_FILE)
    check_bytes(path / META_FILE, meta_bytes, read_meta_digest(path), verify)
    meta = load_torch_file(path / META_FILE, weights_only, data=meta_bytes)
    saved = (meta.get(LAYOUT_KEY) if isinstance(meta, dict) else None) or {}
    if not isinstance(saved, dict):
        raise CheckpointIntegrityError(f"{path / META_FILE}: its {LAYOUT_KEY!r} entry is not a dict.")
    metadata_bytes = read_member(path, DCP_METADATA)
    records = saved.get("files")
    check_bytes(path / DCP_METADATA, metadata_bytes, records.get(DCP_METADATA) if isinstance(records, dict) else None,
                verify)
    metadata = parse_dcp_metadata(metadata_bytes, path / DCP_METADATA)
    check_complete(path, metadata, saved)
    check_storage(metadata, path)
    return meta, metadata

