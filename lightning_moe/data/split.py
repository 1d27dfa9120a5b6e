"""`split_corpus`: the training / validation split of a text corpus, by document or inside one document.

A corpus of several documents is split by document (:meth:`TextFiles.split`: a document's side
depends on its relative path only). A corpus of a single document (one text file) cannot be, so
with ``val_fraction > 0`` the document itself is cut in two: its last lines, about
``val_fraction`` of its characters, are the validation part, the lines before them the training
part. The cut is deterministic (a function of the text alone): the line boundary nearest to
character ``round((1 - val_fraction) * len(text))`` that leaves both parts non-empty (the later one
on a tie), or that character position itself when the document is a single line.

:func:`build_datasets` and :func:`pretokenize` split through :func:`split_corpus`, so checking a
configuration before training (the number of documents, how they split) gives what training will
do.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_moe.data.files import (
    PathLike,
    TextFiles,
    _check_val_fraction,
    is_token_directory,
    stdlib_corpus,
    stdlib_dir,
)

__all__ = ["CorpusSplit", "TextPart", "split_corpus"]


@dataclass(frozen=True)
class TextPart(Sequence[str]):
    """Characters ``[start, stop)`` of the text file ``root / relative_path``: a corpus of one document.

    Read on access, decoded as :class:`TextFiles` does (UTF-8, invalid bytes replaced).
    """

    root: Path
    relative_path: str
    start: int
    stop: int | None

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        if index not in (0, -1):
            raise IndexError(f"a TextPart holds one document; index {index} is out of range")
        return TextFiles(self.root, (self.relative_path,)).read(0)[self.start : self.stop]

    def __iter__(self) -> Iterator[str]:
        yield self[0]


@dataclass(frozen=True)
class CorpusSplit:
    """What :func:`split_corpus` returns.

    Attributes:
        train: the training documents, in corpus order (a :class:`TextFiles` or a :class:`TextPart`).
        val: the validation documents (empty when ``val_fraction`` is 0).
        num_documents: documents (files) in the corpus.
        by: ``"document"``, or ``"lines"`` / ``"characters"`` for a single document cut in two.
    """

    train: Sequence[str]
    val: Sequence[str]
    num_documents: int
    by: str

    def describe(self, side: str) -> str:
        """Where the ``"train"`` or ``"val"`` part comes from, for messages."""
        part = self.train if side == "train" else self.val
        if isinstance(part, TextPart):
            return f"{self.by} [{part.start}:{'' if part.stop is None else part.stop}] of {part.root / part.relative_path}"
        return f"{len(part)} files under {part.root}"


def _cut(text: str, val_fraction: float) -> tuple[int, str]:
    """The character where validation starts (inside ``text``), and ``"lines"`` when that is a line start."""
    target = round((1 - val_fraction) * len(text))
    # Line starts that leave both parts non-empty: after a newline, before the last character.
    before = text.rfind("\n", 0, min(target, len(text) - 1))
    after = text.find("\n", max(target - 1, 0), len(text) - 1)
    starts = [index + 1 for index in (before, after) if index >= 0]
    if not starts:
        return min(max(target, 1), len(text) - 1), "characters"
    return min(starts, key=lambda start: (abs(start - target), -start)), "lines"


def _stdlib_files() -> TextFiles:
    # Relative to the stdlib directory itself, so the split keys are the module paths ("json/decoder.py").
    root = stdlib_dir()
    return TextFiles(root, tuple(path.relative_to(root).as_posix() for path in stdlib_corpus()))


def split_corpus(
    source: PathLike | Sequence[PathLike] | TextFiles | None, val_fraction: float, pattern: str = "*.txt"
) -> CorpusSplit:
    """The training / validation split of a text corpus (see the module docstring for the rule).

    Args:
        source: a file, a directory, a list of those (:meth:`TextFiles.discover` with
            ``pattern``), a :class:`TextFiles`, or ``None`` for the Python standard library
            (:func:`~lightning_moe.data.stdlib_corpus`).
        val_fraction: share for validation, in ``[0, 1)``; ``0`` gives an empty validation part.

    Several documents split by document (:meth:`TextFiles.split`); one document with
    ``val_fraction > 0`` is cut into its first and last lines (reading it). Raises
    ``FileNotFoundError`` for a missing source or one without files, ``ValueError`` for a
    ``val_fraction`` outside ``[0, 1)``, a pre-tokenized directory (its split was fixed by
    :func:`~lightning_moe.data.pretokenize`), or a single document of fewer than 2 characters.
    """
    _check_val_fraction(val_fraction)
    if is_token_directory(source):
        raise ValueError(f"{source} is a pre-tokenized corpus: its split was fixed by pretokenize, not split again")
    if isinstance(source, TextFiles):
        files = source
    else:
        files = _stdlib_files() if source is None else TextFiles.discover(source, pattern)
    if len(files) != 1 or val_fraction == 0:
        train, val = files.split(val_fraction)
        return CorpusSplit(train, val, len(files), "document")
    text = files[0]
    if len(text) < 2:
        raise ValueError(
            f"{files.paths[0]} is the only document and holds {len(text)} characters: it cannot be cut into a "
            f"training and a validation part for val_fraction={val_fraction}; add text or files, or set val_fraction=0"
        )
    cut, by = _cut(text, val_fraction)
    (relative,) = files.relative_paths
    return CorpusSplit(TextPart(files.root, relative, 0, cut), TextPart(files.root, relative, cut, None), 1, by)
