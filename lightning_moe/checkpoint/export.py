"""Export a checkpoint's model weights as one ``torch.save`` file, for inference or another framework.

:func:`export_checkpoint` reads a checkpoint of any layout (a sharded ``MoEStrategy`` directory
written at any TP/EP/ETP size, or a consolidated single file such as
``MoEStrategy(save_distributed_checkpoint=False)`` or a single-device Lightning run writes) and
writes the model's *global* state dict: the keys and shapes of ``model.state_dict()`` of the
single-device LightningModule, plain tensors only. It loads with ``torch.load(path,
weights_only=True)`` and ``model.load_state_dict(state, strict=True)``; optimizer states, loops
and hyperparameters are left out.

No model class is needed. The checkpoint is opened and checked by
:func:`~lightning_moe.checkpoint.reader.open_checkpoint` (completeness, ``.metadata``'s
entries against the files, SHA-256 digests unless ``verify=False``; nothing in it runs code),
then read a batch of tensors at a time, each batch no larger than the largest tensor: a sharded
directory through DCP in this one process (whatever the saving layout, every shard's piece goes
into the full tensors), a consolidated file memory-mapped. Each tensor is written to the output
as soon as it is read (:class:`~lightning_moe.checkpoint.torch_file_stream.TorchFileStream`), so
the process holds about twice the largest tensor (a batch and the piece DCP is reading into it),
never the model.

The output is written next to its final path under a hidden temporary name, flushed and
``fsync``-ed, then renamed into place: a crash or a full disk leaves the previous file (or none),
never half a file; a failed write raises the ``OSError`` with its errno.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_moe.checkpoint.files import find_os_error, partial_path
from lightning_moe.checkpoint.reader import MODEL_KEY, CheckpointSource, open_checkpoint
from lightning_moe.checkpoint.torch_file_stream import TorchFileStream
from lightning_moe.compat import set_element

__all__ = ["MODEL_KEY", "ExportedCheckpoint", "export_checkpoint", "read_checkpoint", "read_model_state", "write_failure"]


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


def read_model_state(checkpoint: str | os.PathLike, verify: bool = True) -> tuple[dict[str, Any], str, dict | None, bool]:
    """``(state_dict, kind, layout, verified)`` of ``checkpoint``: the model's global state dict
    (see the module docstring; all of it in memory), ``"sharded"`` or ``"consolidated"``, the
    saving layout if recorded, and whether the checksums were verified. One process, no process group."""
    return read_checkpoint(checkpoint, verify)[:4]


def read_checkpoint(
    checkpoint: str | os.PathLike, verify: bool = True
) -> tuple[dict[str, Any], str, dict | None, bool, dict[str, Any]]:
    """:func:`read_model_state` and, last, everything else the checkpoint holds but tensors
    (Lightning's ``hyper_parameters``, the LightningModule's own entries), read with ``weights_only``.
    To go through the model a few tensors at a time instead, use
    :func:`~lightning_moe.checkpoint.reader.open_checkpoint`."""
    source = open_checkpoint(checkpoint, verify)
    return source.read_all(), source.kind, source.layout, source.verified, source.extras


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


def write_failure(output: Path, err: BaseException) -> BaseException:
    """The error for a failed write of ``output``: an ``OSError`` with its errno when one caused it
    (torch's zip writer reports a failed write as "unexpected pos", the ``OSError`` in its context)."""
    os_error = find_os_error(err)
    if os_error is None:
        return err
    strerror = os_error.strerror or os.strerror(os_error.errno)
    return OSError(os_error.errno, f"Could not write {output}: {strerror}")


def _write_streamed(source: CheckpointSource, output: Path, before_replace: Callable[[], None]) -> None:
    """Write the model state of ``source`` to ``output`` atomically, a batch of tensors at a time;
    ``before_replace`` runs (and may raise) right before the finished file is renamed into place."""
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(output, uuid.uuid4().hex)
    try:
        with open(partial, "wb") as file:
            stream = TorchFileStream(file)
            try:
                state: dict[str, Any] = {}
                for batch in source.batches():
                    for path, value in batch.items():
                        set_element(state, path, stream.add(value) if isinstance(value, Tensor) else value)
                    batch = value = None  # dropped before the next batch is read
                stream.finish(state)
            except BaseException:
                stream.abandon()
                raise
            file.flush()
            os.fsync(file.fileno())
        before_replace()
        os.replace(partial, output)
    except BaseException as err:
        with contextlib.suppress(OSError):
            partial.unlink()
        failure = write_failure(output, err)
        if failure is err:
            raise
        raise failure from err


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
        OSError: ``output`` cannot be written (e.g. a full disk: its errno); the previous file stays.
    """
    source, target = Path(checkpoint), Path(output)
    _check_output(target, source, overwrite)
    opened = open_checkpoint(source, verify=verify)
    # The output may have appeared while the checkpoint was read.
    _write_streamed(opened, target, lambda: _check_output(target, source, overwrite))
    tensors = [entry for entry in opened.entries if entry.shape is not None]
    return ExportedCheckpoint(
        source=source, output=target, kind=opened.kind, num_tensors=len(tensors),
        num_bytes=sum(entry.nbytes for entry in tensors), layout=opened.layout, verified=opened.verified,
    )
