"""Export a checkpoint's model weights as one ``torch.save`` file, for inference or another framework.

:func:`export_checkpoint` reads a checkpoint of any layout (a sharded ``MoEStrategy`` directory
written at any TP/EP/ETP size, or a consolidated single file such as
``MoEStrategy(save_distributed_checkpoint=False)`` or a single-device Lightning run writes) and
writes the model's *global* state dict: the keys and shapes of ``model.state_dict()`` of the
single-device LightningModule, plain tensors only. It loads with ``torch.load(path,
weights_only=True)`` and ``model.load_state_dict(state, strict=True)``; optimizer states, loops
and hyperparameters are left out.

No model class is needed. For a sharded directory the empty global state dict is built from
DCP's ``.metadata`` (every ``state_dict`` entry's shape and dtype, its nesting from the
planner's recorded paths) and filled by :func:`~lightning_moe.parallel.checkpoint_security.load_sharded`
in this one process, without a process group: whatever the saving layout, DCP reads every
shard's piece into the full tensors. Before that, as when resuming, the directory is checked for
completeness (``meta.pt``, ``.metadata`` of the same save, every shard present and long enough, a
regular file inside the folder, not a link), ``.metadata``'s entries are checked to cover every
tensor exactly and ask for no more bytes than the files hold (so nothing uninitialised is written
and nothing larger than the checkpoint allocated), and, unless ``verify=False``, every file is
checked against the SHA-256 recorded at save (``meta.pt`` and ``.metadata`` before they are
unpickled). Nothing in the
checkpoint runs code: ``meta.pt`` and consolidated files load with ``weights_only=True``, DCP's
metadata through the allowlist.

The output is written next to its final path under a hidden temporary name, flushed and
``fsync``-ed, then renamed into place: a crash or a full disk leaves the previous file (or none),
never half a file. The whole model is held in this process's memory once.
"""

from __future__ import annotations

import contextlib
import os
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from lightning_moe.parallel.checkpoint_files import interrupted_replacement, partial_path, write_torch_file
from lightning_moe.parallel.checkpoint_integrity import (
    DCP_METADATA,
    LAYOUT_KEY,
    META_FILE,
    has_digests,
    verify_digests,
)
from lightning_moe.parallel.checkpoint_security import load_sharded, load_torch_file, read_sharded_metadata

__all__ = ["ExportedCheckpoint", "export_checkpoint", "read_checkpoint", "read_model_state"]

MODEL_KEY = "state_dict"
"""Where Lightning keeps the model's state in a checkpoint (in a sharded one, the DCP prefix)."""


@dataclass(frozen=True)
class ExportedCheckpoint:
    """What :func:`export_checkpoint` read and wrote."""

    source: Path
    """The checkpoint read."""
    output: Path
    """The file written."""
    kind: str
    """``"sharded"`` (a DCP directory) or ``"consolidated"`` (one file)."""
    num_tensors: int
    """Tensors in the exported state dict."""
    num_bytes: int
    """Their total size in bytes."""
    layout: dict[str, Any] | None
    """The layout the checkpoint was saved at (``MoEStrategy``'s record), None if unknown."""
    verified: bool
    """Whether every file was checked against its recorded SHA-256."""

    def describe(self) -> str:
        """One line for the command line."""
        saved_at = ""
        if self.layout:
            sizes = ", ".join(f"{k.upper()}={self.layout[k]}" for k in ("tp", "ep", "etp") if k in self.layout)
            saved_at = f", saved at world size {self.layout.get('world_size', '?')}" + (f" ({sizes})" if sizes else "")
        if self.verified:
            check = "checksums verified"
        elif self.kind == "consolidated":
            check = "a single file records no checksums"
        else:
            check = "checksums not verified"
        return (
            f"Exported {self.num_tensors} tensors ({self.num_bytes / 2**20:.1f} MiB) of the {self.kind} checkpoint "
            f"{self.source}{saved_at} ({check}) to {self.output}"
        )


def _tensors(obj: Any) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in _tensors(value)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in _tensors(value)]
    return []


def _missing(path: Path) -> FileNotFoundError:
    previous = interrupted_replacement(path)
    hint = (
        f"; a save was interrupted while replacing it, and the previous complete checkpoint is {previous}: export that"
        if previous is not None else ""
    )
    return FileNotFoundError(2, f"Checkpoint {path} does not exist{hint}")


def _model_template(metadata: Any, source: Path) -> dict[str, Any]:
    """The empty global ``state_dict`` tree of a DCP checkpoint: tensors of the saved shapes and
    dtypes, ``None`` where a non-tensor (bytes) item will be unpickled with ``weights_only``."""
    paths = getattr(metadata, "planner_data", None) or {}
    template: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        path = paths.get(fqn)
        if path is None:  # no recorded nesting (another writer): the flat key after the prefix
            if not fqn.startswith(MODEL_KEY + "."):
                continue
            path = (MODEL_KEY, fqn[len(MODEL_KEY) + 1 :])
        if path[0] != MODEL_KEY:
            continue  # optimizer states and anything else
        if isinstance(item, TensorStorageMetadata):
            value: Any = torch.empty(item.size, dtype=item.properties.dtype)
        elif isinstance(item, BytesStorageMetadata):
            value = None
        else:
            raise ValueError(f"{source}: the checkpoint entry {fqn!r} has an unknown kind {type(item).__name__}.")
        set_element(template, tuple(path), value)
    if MODEL_KEY not in template:
        raise ValueError(f"{source} holds no model state (no {MODEL_KEY!r} entries in {DCP_METADATA}).")
    return template


def _read_sharded(path: Path, verify: bool) -> tuple[dict[str, Any], dict[str, Any] | None, bool, dict[str, Any]]:
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
    template = _model_template(metadata, path)
    with warnings.catch_warnings():
        # Loading in one process is the point here, not an accident DCP should warn about.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        load_sharded(template, path, metadata=metadata)
    return template[MODEL_KEY], saved.get("layout"), verified, meta if isinstance(meta, dict) else {}


def _read_consolidated(path: Path) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    checkpoint = load_torch_file(path, weights_only=True)
    state = checkpoint.get(MODEL_KEY) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ValueError(
            f"{path} is not a Lightning checkpoint: no {MODEL_KEY!r} entry (keys: "
            f"{sorted(map(str, checkpoint))[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__}); "
            "it may already be an exported state dict."
        )
    saved = checkpoint.get(LAYOUT_KEY) or {}
    extras = {k: v for k, v in checkpoint.items() if k != MODEL_KEY}
    return state, saved.get("layout") if isinstance(saved, dict) else None, extras


def read_model_state(checkpoint: str | os.PathLike, verify: bool = True) -> tuple[dict[str, Any], str, dict | None, bool]:
    """``(state_dict, kind, layout, verified)`` of ``checkpoint``: the model's global state dict
    (see the module docstring), ``"sharded"`` or ``"consolidated"``, the saving layout if
    recorded, and whether the checksums were verified. One process, no process group."""
    return read_checkpoint(checkpoint, verify)[:4]


def read_checkpoint(
    checkpoint: str | os.PathLike, verify: bool = True
) -> tuple[dict[str, Any], str, dict | None, bool, dict[str, Any]]:
    """:func:`read_model_state` and, last, everything else the checkpoint holds but tensors
    (Lightning's ``hyper_parameters``, the LightningModule's own entries), read with ``weights_only``."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            f"Exporting a checkpoint runs in one process, but this one is rank {dist.get_rank()} of a process "
            f"group of {dist.get_world_size()}: run `lightning-moe export` (or export_checkpoint) outside the "
            "distributed job, e.g. after training."
        )
    path = Path(checkpoint)
    if not path.exists():
        raise _missing(path)
    if path.is_dir():
        state, layout, verified, extras = _read_sharded(path, verify)
        return state, "sharded", layout, verified, extras
    state, layout, extras = _read_consolidated(path)
    return state, "consolidated", layout, False, extras


def _check_output(output: Path, checkpoint: Path, overwrite: bool) -> None:
    if output.is_dir():
        raise IsADirectoryError(21, f"The output {output} is a directory; name the file to write, e.g. {output / 'model.pt'}")
    source = checkpoint.resolve()
    target = output.resolve()
    if target == source or (source.is_dir() and source in target.parents):
        raise ValueError(
            f"The output {output} is inside the checkpoint {checkpoint}; write the export elsewhere, the "
            "checkpoint stays as it is."
        )
    if (output.exists() or output.is_symlink()) and not overwrite:
        raise FileExistsError(17, f"The output {output} already exists; pass --overwrite (overwrite=True) to replace it")


def _write_atomically(state: dict[str, Any], output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(output, uuid.uuid4().hex)
    try:
        write_torch_file(state, partial)
        os.replace(partial, output)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise


def export_checkpoint(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    overwrite: bool = False,
    verify: bool = True,
) -> ExportedCheckpoint:
    """Write the model weights of ``checkpoint`` (any layout) to the single file ``output``.

    Args:
        checkpoint: a sharded checkpoint directory or a consolidated checkpoint file.
        output: the file to write (its folder is created if needed).
        overwrite: replace an existing ``output`` (atomically, and only once the export succeeded).
        verify: check every file of a sharded checkpoint against its recorded SHA-256 first.
            Completeness and sizes are checked either way.

    Raises:
        FileNotFoundError: ``checkpoint`` is missing, is not a checkpoint, or lacks a file.
        FileExistsError: ``output`` exists and ``overwrite`` is False.
        CheckpointIntegrityError: a file is truncated, of another save, or fails its checksum.
        UnsafeCheckpointError: the checkpoint holds something loading it would have to execute.
        RuntimeError: called on one rank of a multi-rank process group.
    """
    source, target = Path(checkpoint), Path(output)
    _check_output(target, source, overwrite)
    state, kind, layout, verified = read_model_state(source, verify=verify)
    _check_output(target, source, overwrite)  # it may have appeared while the checkpoint was read
    _write_atomically(state, target)
    tensors = _tensors(state)
    return ExportedCheckpoint(
        source=source, output=target, kind=kind, num_tensors=len(tensors),
        num_bytes=sum(t.numel() * t.element_size() for t in tensors), layout=layout, verified=verified,
    )
