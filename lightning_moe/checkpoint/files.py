"""Atomic replacement of a checkpoint path, and errors that name the path and the errno.

A save of ``<dir>/<stem><suffix>`` (e.g. ``last.ckpt``, a folder or a file) writes into a
sibling and renames it into place once it is complete (rank 0, after every rank finished):

* ``<dir>/.<stem><suffix>.partial-<save id>``: the save in progress. Hidden and not ending in
  ``.ckpt``, so Lightning's ``ckpt_path="last"`` never picks it, nor does any loader.
* ``<dir>/<stem>.replaced-<save id><suffix>``: the previous checkpoint, renamed aside for the
  moment between the two renames of :func:`replace` (there is no portable atomic swap of two
  folders). It keeps the stem and the suffix on purpose: ``ckpt_path="last"`` (``last*.ckpt``)
  finds it, and loading the missing path falls back to it (:func:`interrupted_replacement`).

What a crash leaves, at each point:

* while writing, or before the first rename: the old checkpoint, untouched, and a partial sibling
  that no loader reads; the next save of that name removes it (:func:`prepare_partial`);
* between the two renames: no ``<name>``; the old checkpoint, complete, as ``*.replaced-*``; the
  new one, complete, as the partial sibling. Loading ``<name>`` and ``"last"`` use the old one;
  the next save of that name removes both leftovers after its own rename;
* after the second rename: the new checkpoint in place (its mtime refreshed, so it is the newest
  ``last*.ckpt``) and the old one aside until it is deleted a moment later or by the next save.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from lightning_moe.checkpoint.integrity import DCP_METADATA, META_DIGEST_FILE, META_FILE

__all__ = [
    "describe_write_error",
    "find_os_error",
    "interrupted_replacement",
    "leftovers",
    "partial_path",
    "prepare_partial",
    "probe_writable",
    "rank_failures",
    "removal_refusal",
    "remove_path",
    "replace",
    "replaced_path",
    "write_bytes_file",
]

_PARTIAL = ".partial-"
_REPLACED = ".replaced-"


def partial_path(path: Path, save_id: str) -> Path:
    """Where the save ``save_id`` of ``path`` is written before it is renamed into place."""
    return path.with_name(f".{path.name}{_PARTIAL}{save_id}")


def replaced_path(path: Path, save_id: str) -> Path:
    """Where the previous checkpoint at ``path`` waits while the save ``save_id`` takes its place."""
    return path.with_name(f"{path.stem}{_REPLACED}{save_id}{path.suffix}")


def leftovers(path: Path, partial: bool = True, replaced: bool = True) -> list[Path]:
    """Siblings of ``path`` left by interrupted saves (partial and/or replaced ones)."""
    patterns = []
    if partial:
        patterns.append(re.compile(rf"\.{re.escape(path.name)}{re.escape(_PARTIAL)}[0-9a-f]+"))
    if replaced:
        patterns.append(re.compile(rf"{re.escape(path.stem)}{re.escape(_REPLACED)}[0-9a-f]+{re.escape(path.suffix)}"))
    if not path.parent.is_dir():
        return []
    return sorted(p for p in path.parent.iterdir() if any(pattern.fullmatch(p.name) for pattern in patterns))


def remove_path(path: Path) -> None:
    """Delete a file, link or folder; nothing if it does not exist."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path)


_WRITTEN = re.compile(rf"{re.escape(META_FILE)}|{re.escape(DCP_METADATA)}|{re.escape(META_DIGEST_FILE)}|__\d+_\d+\.distcp")
"""Names of the files a sharded save of this package writes (DCP names its shards ``__<rank>_<n>.distcp``)."""


def _is_written_folder(folder: Path) -> bool:
    # Only regular files of the names a save writes: a folder with anything else is not ours.
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return False
    return all(_WRITTEN.fullmatch(e.name) and e.is_file(follow_symlinks=False) for e in entries)


def removal_refusal(path: Path, dirpaths: list[Path] | None) -> str | None:
    """Why ``path`` must not be deleted as a checkpoint, or None when it may be.

    ``path`` is resolved first (its folder through any links): it must lie directly in one of the
    resolved ``dirpaths`` (the checkpoint callbacks' folders; None when unknown) and be a link, a
    file, or a folder holding only the files a sharded save writes. A checkpoint path restored from
    a crafted ``meta.pt`` (``<dirpath>/../victim``) is refused, not removed.
    """
    if path.name in ("", ".", ".."):
        return f"{path} does not name a checkpoint"
    target = path.parent.resolve() / path.name
    if dirpaths is not None and target.parent not in {Path(d).resolve() for d in dirpaths}:
        return f"{path} is not directly in the checkpoint directory ({', '.join(map(str, dirpaths)) or 'none'})"
    if target.is_dir() and not target.is_symlink() and not _is_written_folder(target):
        return f"{path} is a folder that holds files a lightning_moe checkpoint does not write"
    return None


def _fsync_dir(directory: Path) -> None:
    # Make the renames durable; not every file system supports fsync on a folder.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prepare_partial(path: Path, save_id: str, directory: bool) -> Path:
    """Remove partial saves of ``path`` left by crashes and return the new partial path (created
    empty when ``directory``). Replaced leftovers stay: they may be the only complete copy."""
    for stale in leftovers(path, replaced=False):
        remove_path(stale)
    partial = partial_path(path, save_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        partial.mkdir()
    return partial


def replace(partial: Path, path: Path, save_id: str) -> None:
    """Put the complete ``partial`` at ``path``: old one aside, new one in, old one (and any
    leftover of earlier interrupted saves of ``path``) deleted. See the module docstring."""
    aside = None
    if path.exists() or path.is_symlink():
        aside = replaced_path(path, save_id)
        os.rename(path, aside)
    os.rename(partial, path)
    os.utime(path)  # the newest last*.ckpt for ckpt_path="last", whatever the leftovers' mtimes
    _fsync_dir(path.parent)
    for old in ([aside] if aside is not None else []) + leftovers(path):
        remove_path(old)


def write_bytes_file(data: bytes, path: Path) -> None:
    """Write ``data`` to ``path``, flushed and ``fsync``-ed (a full disk raises the ``OSError``)."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _is_complete(path: Path) -> bool:
    return path.is_file() or (path / META_FILE).is_file()


def interrupted_replacement(path: Path) -> Path | None:
    """The newest complete checkpoint that a save interrupted between its renames left for the
    missing ``path`` (see the module docstring), or None."""
    candidates = [p for p in leftovers(path, partial=False) if _is_complete(p)]
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def rank_failures(err: CheckpointException) -> dict[int, BaseException]:
    """Each failed rank's exception in DCP's ``CheckpointException`` (DCP stores some with their traceback)."""
    return {rank: (f[0] if isinstance(f, tuple) else f) for rank, f in err.failures.items()}


def find_os_error(err: BaseException) -> OSError | None:
    """The first ``OSError`` with an errno in ``err``, its causes and contexts, and DCP's per-rank failures.

    ``torch.save`` reports a failed write as "unexpected pos ..." with the ``OSError`` of the
    file object as its context; DCP wraps each rank's exception in a ``CheckpointException``.
    """
    pending, seen = [err], set()
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        if isinstance(current, CheckpointException):
            pending.extend(rank_failures(current).values())
        pending.extend((current.__cause__, current.__context__))
    return None


def _free_space(directory: Path) -> str:
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return "free space unknown"
    return f"{free / 2**30:.1f} GiB free on the file system of {directory}"


def _summary(err: BaseException) -> str:
    if isinstance(err, CheckpointException):
        return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(rank_failures(err).items()))
    return f"{type(err).__name__}: {err}"


def describe_write_error(path: Path, err: BaseException) -> OSError | RuntimeError:
    """An error for a failed save of ``path``: ``OSError`` with the errno when one caused it."""
    os_error = find_os_error(err)
    if os_error is not None:
        where = f" ({os_error.filename})" if os_error.filename else ""
        strerror = os_error.strerror or os.strerror(os_error.errno)
        return OSError(os_error.errno, f"Could not write the checkpoint {path}: {strerror}{where}; {_free_space(path.parent)}")
    return RuntimeError(f"Could not write the checkpoint {path}: {_summary(err)}; {_free_space(path.parent)}")


def probe_writable(directory: Path) -> OSError | None:
    """Create ``directory`` if needed, then create and remove a file in it; the ``OSError`` if that fails."""
    probe = directory / f".lightning_moe-write-test-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as err:
        with_errno = err if err.errno is not None else OSError(errno.EIO, str(err))
        return OSError(
            with_errno.errno,
            f"Checkpoint directory {directory} is not writable: {with_errno.strerror or with_errno} "
            f"({with_errno.filename or directory}). Fix its permissions or point ModelCheckpoint(dirpath=...) elsewhere.",
        )
    return None
