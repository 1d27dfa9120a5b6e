"""Text corpora on disk: `TextFiles` (discovery, reading, document split) and `stdlib_corpus`.

Order and split never depend on the file system's listing order or on where the corpus lives:
files are sorted by their path relative to the corpus root, and the train / validation split is a
function of that relative path alone (``zlib.crc32`` of its UTF-8 bytes, modulo
:data:`SPLIT_BUCKETS`). The same files under another directory, on another machine, give the same
order and the same split.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, overload

__all__ = [
    "SPLIT_BUCKETS",
    "TOKENS_META",
    "PathLike",
    "TextFiles",
    "is_token_directory",
    "is_validation_document",
    "stdlib_corpus",
    "stdlib_dir",
]

PathLike = str | os.PathLike
SPLIT_BUCKETS = 1000
TOKENS_META = "tokens.json"
"""The file that marks a directory written by :func:`~lightning_moe.data.pretokenize`."""
"""A document is in validation when ``crc32(relative path) % SPLIT_BUCKETS < val_fraction * SPLIT_BUCKETS``."""

# Directories of the standard library that are not the library itself (third-party packages, test
# suites, IDLE, the removed 2to3) or that the build generates per machine (``config-*``).
_STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "lib-dynload"}
)
# Generated at build time with the machine's paths and compiler flags.
_STDLIB_EXCLUDED_FILE_PREFIXES = ("_sysconfigdata",)


def is_validation_document(relative_path: str, val_fraction: float) -> bool:
    """Whether the document at ``relative_path`` (POSIX form) belongs to the validation split."""
    _check_val_fraction(val_fraction)
    bucket = zlib.crc32(relative_path.encode("utf-8")) % SPLIT_BUCKETS
    return bucket < round(val_fraction * SPLIT_BUCKETS)


def _check_val_fraction(val_fraction: float) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")


def _sort_key(relative_path: str) -> tuple[str, ...]:
    # Directory-tree order by path components ("a/b" before "a-b"), the same on every OS.
    return PurePosixPath(relative_path).parts


@dataclass(frozen=True)
class TextFiles(Sequence[str]):
    """An ordered collection of UTF-8 text files under ``root``; item ``i`` is the text of file ``i``.

    Build it with :meth:`discover`. Files are read on access (``files[i]``), decoded as UTF-8 with
    invalid bytes replaced by U+FFFD, without newline translation. ``relative_paths`` (POSIX form,
    sorted) identify the documents: they fix the order and the train / validation split.
    """

    root: Path
    relative_paths: tuple[str, ...]

    @classmethod
    def discover(cls, source: PathLike | Sequence[PathLike], pattern: str = "*.txt") -> TextFiles:
        """The text files of ``source``, sorted by relative path.

        ``source`` is a file, a directory (searched recursively for file names matching the glob
        ``pattern``, via ``Path.rglob``), or a list of files and directories. The root, against
        which relative paths are taken, is the directory itself, a file's parent directory, or for
        a list the common directory of those roots. A file listed twice is kept once.

        Raises ``FileNotFoundError`` naming a path that does not exist, or a directory with no
        file matching ``pattern``; ``ValueError`` for an empty list.
        """
        sources = [source] if isinstance(source, (str, os.PathLike)) else list(source)
        if not sources:
            raise ValueError("source is an empty list of paths; give at least one file or directory")
        # abspath normalises without following symlinks, so relative paths keep the names the user sees.
        paths = [Path(os.path.abspath(os.fspath(entry))) for entry in sources]
        for path in paths:
            if not path.exists():
                raise FileNotFoundError(f"text source {path} does not exist")
        roots = [path if path.is_dir() else path.parent for path in paths]
        root = Path(os.path.commonpath([str(r) for r in roots]))
        relative: set[str] = set()
        for path in paths:
            if path.is_dir():
                found = [f for f in path.rglob(pattern) if f.is_file()]
                if not found:
                    raise FileNotFoundError(f"no files matching {pattern!r} under directory {path}")
            else:
                found = [path]
            relative.update(f.relative_to(root).as_posix() for f in found)
        return cls(root=root, relative_paths=tuple(sorted(relative, key=_sort_key)))

    @property
    def paths(self) -> tuple[Path, ...]:
        """Absolute paths, in order."""
        return tuple(self.root / rel for rel in self.relative_paths)

    def read(self, index: int) -> str:
        """Text of file ``index`` (UTF-8, ``errors="replace"``)."""
        return (self.root / self.relative_paths[index]).read_bytes().decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return len(self.relative_paths)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> TextFiles: ...
    def __getitem__(self, index: int | slice) -> str | TextFiles:
        """Text of file ``index``; a slice gives the sub-collection of those files (not read)."""
        if isinstance(index, slice):
            return TextFiles(self.root, self.relative_paths[index])
        return self.read(index)

    def __iter__(self) -> Iterator[str]:
        return (self.read(i) for i in range(len(self)))

    def split(self, val_fraction: float) -> tuple[TextFiles, TextFiles]:
        """``(train, val)``: a disjoint split by document, each part in this collection's order.

        A document goes to validation when :func:`is_validation_document` says so; this depends
        only on its relative path, so adding or removing other files never moves it. One exception
        keeps small corpora usable: when ``val_fraction > 0`` picks no document although there are
        at least two, the document with the smallest checksum goes to validation.
        ``val_fraction == 0`` gives an empty validation part. Raises ``ValueError`` when
        ``val_fraction`` is outside ``[0, 1)``, or is positive for a single document (which cannot
        be split by document).
        """
        _check_val_fraction(val_fraction)
        if val_fraction > 0 and len(self) < 2:
            raise ValueError(
                f"val_fraction={val_fraction} needs at least 2 documents to split by document, but the "
                f"corpus under {self.root} has {len(self)}; use more files or val_fraction=0"
            )
        in_val = [is_validation_document(rel, val_fraction) for rel in self.relative_paths]
        if val_fraction > 0 and not any(in_val):
            smallest = min(
                range(len(self)), key=lambda i: (zlib.crc32(self.relative_paths[i].encode("utf-8")), i)
            )
            in_val[smallest] = True
        if all(in_val):
            # Possible for tiny corpora and large fractions; the first document keeps training non-empty.
            in_val[0] = False
        train = tuple(rel for rel, v in zip(self.relative_paths, in_val) if not v)
        val = tuple(rel for rel, v in zip(self.relative_paths, in_val) if v)
        return TextFiles(self.root, train), TextFiles(self.root, val)


def stdlib_dir() -> Path:
    """The directory of the running interpreter's standard library.

    ``sysconfig.get_paths()["stdlib"]``, else the directory of the ``os`` module. Raises
    ``FileNotFoundError`` naming both when neither is a directory (e.g. a zipped or frozen stdlib).
    """
    candidates = [sysconfig.get_paths().get("stdlib"), os.path.dirname(os.__file__)]
    for candidate in candidates:
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    raise FileNotFoundError(
        f"the Python standard library is not a directory on this machine: tried {candidates}"
    )


def stdlib_corpus(max_files: int | None = None) -> list[Path]:
    """The standard library's own ``*.py`` files, sorted by relative path: real text, no download.

    Excludes third-party packages (``site-packages``, ``dist-packages``), test suites (``test``,
    ``tests``), ``idlelib``, ``lib2to3``, caches, hidden and ``config-*`` directories, and the
    generated ``_sysconfigdata*`` modules, so the result depends only on the Python installation
    (its version and distribution), not on the machine's build paths or installed packages. Python
    versions ship different files, so the corpus (and its split) differs between versions; for one
    interpreter it is fixed, and a document's side of the split depends only on its module path.
    ``max_files`` keeps the first files in that order. Raises ``FileNotFoundError`` when the stdlib
    is not found or has no such files.
    """
    if max_files is not None and (
        isinstance(max_files, bool) or not isinstance(max_files, int) or max_files < 1
    ):
        raise ValueError(f"max_files must be a positive int or None, got {max_files!r}")
    root = stdlib_dir()
    relative: list[str] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [
            d for d in subdirs if d not in _STDLIB_EXCLUDED_DIRS and not d.startswith((".", "config-"))
        ]
        base = Path(directory).relative_to(root)
        relative.extend(
            (base / name).as_posix()
            for name in files
            if name.endswith(".py") and not name.startswith(_STDLIB_EXCLUDED_FILE_PREFIXES)
        )
    if not relative:
        raise FileNotFoundError(f"no standard-library *.py files under {root}")
    relative.sort(key=_sort_key)
    return [root / rel for rel in relative[:max_files]]


def is_token_directory(source: Any) -> bool:
    """Whether ``source`` is a directory written by :func:`~lightning_moe.data.pretokenize` (a pre-tokenized corpus)."""
    return isinstance(source, (str, os.PathLike)) and (Path(source) / TOKENS_META).is_file()
