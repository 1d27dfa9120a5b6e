"""The model state of a checkpoint of any layout, read a few tensors at a time, in one process.

:func:`open_checkpoint` checks a checkpoint and lists its model entries before any tensor is
read: a sharded ``MoEStrategy`` directory (DCP, written at any TP/EP/ETP size) or a consolidated
single file (``MoEStrategy(save_distributed_checkpoint=False)``, a single-device Lightning run).
:meth:`CheckpointSource.batches` then yields the entries in order, each batch holding at most
``budget`` bytes of tensors (or one tensor larger than that), so a reader of the whole model
holds the batch it is working on and nothing else.

* Sharded: the entries, their shapes and dtypes and their nesting come from DCP's ``.metadata``
  (the planner's recorded paths); each batch is an empty template of those tensors that
  :func:`~lightning_moe.checkpoint.security.load_sharded` fills, without a process
  group: whatever the saving layout, DCP reads every shard's piece into the full tensors (one
  piece at a time, so a batch costs its tensors and one piece). Before that, as when resuming,
  the directory is checked for completeness (``meta.pt``, ``.metadata`` of the same save, every
  shard present and long enough, a regular file inside the folder, not a link), ``.metadata``'s
  entries are checked to cover every tensor exactly and ask for no more bytes than the files hold
  (so nothing uninitialised is read and nothing larger than the checkpoint allocated), and,
  unless ``verify=False``, every file is checked against the SHA-256 recorded at save
  (``meta.pt`` and ``.metadata`` before they are unpickled).
* Consolidated: the file is memory-mapped (``torch.load(mmap=True, weights_only=True)``): its
  tensors are views of the mapping, read from disk as they are used, never copied into memory.

Nothing in a checkpoint runs code: ``meta.pt`` and consolidated files load with
``weights_only=True``, DCP's metadata through the allowlist.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from lightning_moe.checkpoint.files import interrupted_replacement
from lightning_moe.checkpoint.integrity import (
    DCP_METADATA,
    LAYOUT_KEY,
    META_FILE,
    has_digests,
    verify_digests,
)
from lightning_moe.checkpoint.security import load_sharded, load_torch_file, read_sharded_metadata
from lightning_moe.compat import set_element

__all__ = ["MODEL_KEY", "CheckpointSource", "Entry", "open_checkpoint"]

MODEL_KEY = "state_dict"
"""Where Lightning keeps the model's state in a checkpoint (in a sharded one, the DCP prefix)."""


@dataclass(frozen=True)
class Entry:
    """One item of the model state: its path below :data:`MODEL_KEY`, and for a tensor its shape and dtype."""

    path: tuple
    """Keys from the model state down to the item: ``("layers.0.attn.q_proj.weight",)``, or
    longer for values nested inside one key (a module's extra state)."""
    shape: torch.Size | None
    """The tensor's shape; None for a non-tensor value."""
    dtype: torch.dtype | None
    """The tensor's dtype; None for a non-tensor value."""

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor (0 for a non-tensor value)."""
        return 0 if self.shape is None else self.shape.numel() * self.dtype.itemsize


@dataclass
class CheckpointSource:
    """An opened, checked checkpoint (:func:`open_checkpoint`): its model entries, read on demand."""

    path: Path
    """The checkpoint."""
    kind: str
    """``"sharded"`` (a DCP directory) or ``"consolidated"`` (one file)."""
    entries: list[Entry]
    """The model state's items, in the checkpoint's order."""
    layout: dict[str, Any] | None
    """The layout the checkpoint was saved at (``MoEStrategy``'s record), None if unknown."""
    verified: bool
    """Whether every file was checked against its recorded SHA-256."""
    extras: dict[str, Any]
    """Everything else the checkpoint holds (Lightning's ``hyper_parameters``, the LightningModule's entries)."""
    _metadata: Any = None
    _dcp_paths: dict[tuple, tuple] = field(default_factory=dict)
    _state: Any = None

    @property
    def largest(self) -> int:
        """Bytes of the largest tensor."""
        return max((entry.nbytes for entry in self.entries), default=0)

    def read(self, entries: list[Entry]) -> dict[tuple, Any]:
        """``{entry.path: value}`` of ``entries``: full global tensors (views of the mapped file for a
        consolidated checkpoint) and non-tensor values."""
        if self.kind == "consolidated":
            out = {}
            for entry in entries:
                value = self._state
                for key in entry.path:
                    value = value[key]
                out[entry.path] = value
            return out
        template: dict[str, Any] = {}
        for entry in entries:
            value = None if entry.shape is None else torch.empty(entry.shape, dtype=entry.dtype)
            set_element(template, self._dcp_paths[entry.path], value)
        with warnings.catch_warnings():
            # Loading in one process is the point here, not an accident DCP should warn about.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            load_sharded(template, self.path, metadata=self._metadata)
        out = {}
        for entry in entries:
            value: Any = template
            for key in self._dcp_paths[entry.path]:
                value = value[key]
            out[entry.path] = value
        return out

    def batches(self, budget: int | None = None) -> Iterator[dict[tuple, Any]]:
        """:meth:`read` of consecutive entries, each batch at most ``budget`` bytes of tensors (default:
        the largest tensor's) or one larger tensor. Drop each batch before asking for the next."""
        budget = self.largest if budget is None else budget
        batch: list[Entry] = []
        size = 0
        for entry in self.entries:
            if batch and size + entry.nbytes > budget:
                yield self.read(batch)
                batch, size = [], 0
            batch.append(entry)
            size += entry.nbytes
        if batch:
            yield self.read(batch)

    def read_all(self) -> dict[str, Any]:
        """The whole model state (nested as saved): every tensor in memory at once."""
        state: dict[str, Any] = {}
        for batch in self.batches():
            for path, value in batch.items():
                set_element(state, path, value)
        return state


def _missing(path: Path) -> FileNotFoundError:
    previous = interrupted_replacement(path)
    hint = (
        f"; a save was interrupted while replacing it, and the previous complete checkpoint is {previous}: export that"
        if previous is not None else ""
    )
    return FileNotFoundError(2, f"Checkpoint {path} does not exist{hint}")


def _dcp_entries(metadata: Any, source: Path) -> tuple[list[Entry], dict[tuple, tuple]]:
    """The model entries of DCP's metadata, and each one's full DCP path (nesting from the planner's records)."""
    paths = getattr(metadata, "planner_data", None) or {}
    entries, dcp_paths = [], {}
    for fqn, item in metadata.state_dict_metadata.items():
        path = paths.get(fqn)
        if path is None:  # no recorded nesting (another writer): the flat key after the prefix
            if not fqn.startswith(MODEL_KEY + "."):
                continue
            path = (MODEL_KEY, fqn[len(MODEL_KEY) + 1 :])
        if path[0] != MODEL_KEY or len(path) < 2:
            continue  # optimizer states and anything else
        if isinstance(item, TensorStorageMetadata):
            entry = Entry(tuple(path[1:]), torch.Size(item.size), item.properties.dtype)
        elif isinstance(item, BytesStorageMetadata):
            entry = Entry(tuple(path[1:]), None, None)
        else:
            raise ValueError(f"{source}: the checkpoint entry {fqn!r} has an unknown kind {type(item).__name__}.")
        entries.append(entry)
        dcp_paths[entry.path] = tuple(path)
    if not entries:
        raise ValueError(f"{source} holds no model state (no {MODEL_KEY!r} entries in {DCP_METADATA}).")
    return entries, dcp_paths


def _open_sharded(path: Path, verify: bool) -> CheckpointSource:
    for name in (META_FILE, DCP_METADATA):
        if not (path / name).is_file():
            raise FileNotFoundError(
                2, f"{path} is not a sharded checkpoint: no {name} (not a checkpoint, or an interrupted save or copy)"
            )
    meta, metadata = read_sharded_metadata(path, verify=verify)
    saved = (meta.get(LAYOUT_KEY) if isinstance(meta, dict) else None) or {}
    verified = False
    if verify:
        if has_digests(saved.get("files")):
            # .metadata was verified before it was unpickled (read_sharded_metadata); the shards now.
            verify_digests(path, {n: r for n, r in saved["files"].items() if n != DCP_METADATA})
            verified = True
        else:
            warnings.warn(
                f"{path} has no checksums (written by an earlier lightning_moe, with verify_checkpoints=False, or "
                "by other code): its files cannot be verified before exporting.",
                UserWarning, stacklevel=3,
            )
    entries, dcp_paths = _dcp_entries(metadata, path)
    return CheckpointSource(path, "sharded", entries, saved.get("layout"), verified,
                            meta if isinstance(meta, dict) else {}, _metadata=metadata, _dcp_paths=dcp_paths)


def _open_consolidated(path: Path) -> CheckpointSource:
    checkpoint = load_torch_file(path, weights_only=True, mmap=True)
    state = checkpoint.get(MODEL_KEY) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ValueError(
            f"{path} is not a Lightning checkpoint: no {MODEL_KEY!r} entry (keys: "
            f"{sorted(map(str, checkpoint))[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__}); "
            "it may already be an exported state dict."
        )
    entries = [
        Entry((key,), value.shape, value.dtype) if isinstance(value, torch.Tensor) else Entry((key,), None, None)
        for key, value in state.items()
    ]
    saved = checkpoint.get(LAYOUT_KEY) or {}
    extras = {k: v for k, v in checkpoint.items() if k != MODEL_KEY}
    return CheckpointSource(path, "consolidated", entries, saved.get("layout") if isinstance(saved, dict) else None,
                            False, extras, _state=state)


def open_checkpoint(checkpoint: str | os.PathLike, verify: bool = True) -> CheckpointSource:
    """Check ``checkpoint`` (see the module docstring) and list its model entries; no tensor is read yet.

    One process: raises ``RuntimeError`` on one rank of a multi-rank process group.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            f"Exporting a checkpoint runs in one process, but this one is rank {dist.get_rank()} of a process "
            f"group of {dist.get_world_size()}: run `lightning-moe export` (or export_checkpoint) outside the "
            "distributed job, e.g. after training."
        )
    path = Path(checkpoint)
    if not path.exists():
        raise _missing(path)
    return _open_sharded(path, verify) if path.is_dir() else _open_consolidated(path)
