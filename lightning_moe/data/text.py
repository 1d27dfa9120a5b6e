"""`PackedTokenDataset` (documents -> fixed-length next-token samples) and `build_datasets`.

The documents are encoded one after another, each followed by the tokenizer's EOS, into one token
stream; the stream is cut into consecutive, non-overlapping chunks of ``seq_len + 1`` tokens, and
chunk ``i`` gives ``inputs = chunk[:-1]``, ``targets = chunk[1:]``. The tail shorter than a chunk
is dropped. The dataset is map-style, so a sampler (:mod:`lightning_moe.data.loading`, or torch's
``DistributedSampler``) shards it over data-parallel replicas and shuffles it by epoch seed;
everything before that is deterministic.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_moe.data.files import PathLike, is_token_directory
from lightning_moe.data.split import CorpusSplit, split_corpus
from lightning_moe.data.token_files import read_token_meta, read_token_split
from lightning_moe.data.tokenizer import STREAM_DTYPE, ByteTokenizer, Tokenizer, encode_document

__all__ = ["PackedTokenDataset", "Tokenizer", "build_datasets"]

def _check_positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        expected = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _token_stream(
    documents: Iterable[str], tokenizer: Tokenizer, max_tokens: int | None
) -> tuple[Tensor, int]:
    """The EOS-terminated concatenation of the non-empty documents, cut at ``max_tokens``."""
    eos = torch.tensor([tokenizer.eos_id], dtype=STREAM_DTYPE)
    parts: list[Tensor] = []
    total = num_documents = 0
    for text in documents:  # a TextFiles reads lazily: files past the cap are never opened
        if not text:
            continue
        ids = encode_document(tokenizer, text)
        parts += [ids, eos]
        total += len(ids) + 1
        num_documents += 1
        if max_tokens is not None and total >= max_tokens:
            break
    stream = torch.cat(parts) if parts else torch.empty(0, dtype=STREAM_DTYPE)
    if max_tokens is not None and len(stream) > max_tokens:
        stream = stream[:max_tokens].clone()
    return stream, num_documents


class PackedTokenDataset(Dataset[tuple[Tensor, Tensor]]):
    """Fixed-length next-token samples packed from a stream of documents.

    Args:
        documents: texts in order (a :class:`TextFiles` is read lazily); empty ones are skipped.
        tokenizer: anything with ``encode(text)`` and ``eos_id`` (:class:`Tokenizer`).
        seq_len: tokens per sample; each sample consumes ``seq_len + 1`` tokens of the stream.
        max_tokens: keep only the first ``max_tokens`` tokens of the stream (documents after the
            cap are not read); ``None`` keeps all.

    ``dataset[i]`` is ``(inputs, targets)``, two int64 tensors of shape ``[seq_len]`` with
    ``targets[:-1] == inputs[1:]``. Attributes: ``tokens``, the packed stream (1-D int32, after
    the cap, including the tail no sample uses), and ``num_documents``, the documents it holds. Raises ``ValueError`` when ``seq_len`` or ``max_tokens`` is not
    a positive int, or when the stream is shorter than one sample.
    """

    def __init__(
        self,
        documents: Iterable[str],
        tokenizer: Tokenizer,
        seq_len: int,
        max_tokens: int | None = None,
    ) -> None:
        _check_positive_int("seq_len", seq_len)
        _check_positive_int("max_tokens", max_tokens, allow_none=True)
        tokens, num_documents = _token_stream(documents, tokenizer, max_tokens)
        self._init_stream(tokens, num_documents, seq_len, max_tokens)

    @classmethod
    def from_stream(
        cls, tokens: Tensor, seq_len: int, num_documents: int, max_tokens: int | None = None
    ) -> PackedTokenDataset:
        """The dataset of an already packed stream ``tokens`` (1-D integers, EOS after each document),
        e.g. a memory-mapped pre-tokenized file (:mod:`lightning_moe.data.token_files`): kept as
        is (cut to ``max_tokens`` as a view), never copied or tokenized again."""
        _check_positive_int("seq_len", seq_len)
        _check_positive_int("max_tokens", max_tokens, allow_none=True)
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be a 1-D stream, got shape {tuple(tokens.shape)}")
        dataset = cls.__new__(cls)
        dataset._init_stream(tokens[:max_tokens] if max_tokens is not None else tokens, num_documents, seq_len, max_tokens)
        return dataset

    def _init_stream(self, tokens: Tensor, num_documents: int, seq_len: int, max_tokens: int | None) -> None:
        self.seq_len = seq_len
        self.max_tokens = max_tokens
        self.tokens, self.num_documents = tokens, num_documents
        sample_len = seq_len + 1
        if len(self.tokens) < sample_len:
            cap = f", capped at max_tokens={max_tokens}" if max_tokens is not None else ""
            raise ValueError(
                f"the corpus has {len(self.tokens)} tokens ({self.num_documents} non-empty documents{cap}), "
                f"fewer than one sample of seq_len + 1 = {sample_len} tokens; use more text, a larger "
                f"max_tokens or a smaller seq_len"
            )

    @property
    def num_tokens(self) -> int:
        """Length of the packed stream, including the dropped tail."""
        return len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens) // (self.seq_len + 1)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        index = operator.index(index)
        length = len(self)
        if not -length <= index < length:
            raise IndexError(f"sample index {index} is out of range for {length} samples")
        start = (index % length) * (self.seq_len + 1)
        chunk = self.tokens[start : start + self.seq_len + 1].to(torch.int64)
        return chunk[:-1], chunk[1:]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(samples={len(self)}, seq_len={self.seq_len}, "
            f"tokens={self.num_tokens}, documents={self.num_documents})"
        )


def build_datasets(
    source: PathLike | Sequence[PathLike] | None,
    seq_len: int,
    val_fraction: float = 0.05,
    max_tokens: int | None = None,
    tokenizer: Tokenizer | None = None,
    *,
    pattern: str = "*.txt",
) -> tuple[PackedTokenDataset, PackedTokenDataset | None]:
    """Train and validation :class:`PackedTokenDataset`\\ s over a text corpus, split by document.

    Args:
        source: a file, a directory (files matching ``pattern``, recursively), a list of those
            (see :meth:`TextFiles.discover`), or ``None`` for the Python standard library's
            sources (:func:`stdlib_corpus`; ``pattern`` is then ignored), which needs no download;
            or a directory written by :func:`~lightning_moe.data.token_files.pretokenize`, whose
            memory-mapped token files are used as they are (``tokenizer`` and ``pattern`` ignored,
            ``val_fraction`` must be the one it was written with).
        seq_len: tokens per sample.
        val_fraction: share of documents for validation, in ``[0, 1)``; see :meth:`TextFiles.split`.
            ``0`` gives no validation dataset (``None``). A corpus of one document (one file) is
            cut in two instead: its last lines, about ``val_fraction`` of it, for validation (see
            :func:`~lightning_moe.data.split.split_corpus`, which makes every split here).
        max_tokens: total tokens to read, for small demos. Validation gets
            ``max(seq_len + 1, round(max_tokens * val_fraction))`` of them, training the rest;
            each side reads its documents in order and stops at its share. ``None`` reads all.
        tokenizer: defaults to :class:`ByteTokenizer`.
        pattern: glob for file names when ``source`` is or contains a directory.

    Returns ``(train, val)``. Raises ``FileNotFoundError`` for a missing source and ``ValueError``
    for invalid sizes or a corpus too small for one sample on either side.
    """
    _check_positive_int("seq_len", seq_len)
    _check_positive_int("max_tokens", max_tokens, allow_none=True)
    pretokenized = is_token_directory(source)
    if not pretokenized:
        tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
        split = split_corpus(source, val_fraction, pattern)

    train_cap = val_cap = max_tokens
    if max_tokens is not None and val_fraction > 0:
        train_cap, val_cap = _token_budget(max_tokens, seq_len, val_fraction)
        if train_cap < seq_len + 1:
            # Training's share never shrinks as max_tokens grows: search up from below the bound.
            smallest = max(2 * (seq_len + 1), int((seq_len + 0.5) / (1 - val_fraction)) - 1)
            while _token_budget(smallest, seq_len, val_fraction)[0] < seq_len + 1:
                smallest += 1
            raise ValueError(
                f"max_tokens={max_tokens} is too small: validation takes {val_cap} tokens and training "
                f"needs at least seq_len + 1 = {seq_len + 1}; use max_tokens >= {smallest}"
            )
    if pretokenized:
        return _token_datasets(Path(source), seq_len, val_fraction, train_cap, val_cap)
    train = _split_dataset("training", split, "train", tokenizer, seq_len, train_cap)
    val = _split_dataset("validation", split, "val", tokenizer, seq_len, val_cap) if val_fraction > 0 else None
    return train, val


def _token_datasets(
    source: Path, seq_len: int, val_fraction: float, train_cap: int | None, val_cap: int | None
) -> tuple[PackedTokenDataset, PackedTokenDataset | None]:
    """The datasets of a pre-tokenized directory: its memory-mapped streams, nothing tokenized."""
    meta = read_token_meta(source)
    if meta["val_fraction"] != val_fraction:
        raise ValueError(
            f"{source} was pre-tokenized with val_fraction={meta['val_fraction']}, not {val_fraction}: the split is "
            "fixed when tokenizing; set val_fraction to that value or run pretokenize again."
        )

    def split(name: str, label: str, cap: int | None) -> PackedTokenDataset:
        tokens, offsets = read_token_split(source, name)
        num_documents = len(offsets) - 1 if cap is None else int((offsets[1:] <= cap).sum()) + int(cap not in offsets)
        try:
            return PackedTokenDataset.from_stream(tokens, seq_len, min(num_documents, len(offsets) - 1), cap)
        except ValueError as err:
            raise ValueError(f"{label} split of the pre-tokenized {source}: {err}") from None

    return split("train", "training", train_cap), split("val", "validation", val_cap) if val_fraction > 0 else None


def _token_budget(max_tokens: int, seq_len: int, val_fraction: float) -> tuple[int, int]:
    """``(train, val)`` shares of ``max_tokens``; validation gets at least one sample."""
    val_cap = max(seq_len + 1, round(max_tokens * val_fraction))
    return max_tokens - val_cap, val_cap


def _split_dataset(
    name: str, split: CorpusSplit, side: str, tokenizer: Tokenizer, seq_len: int, max_tokens: int | None
) -> PackedTokenDataset:
    try:
        return PackedTokenDataset(split.train if side == "train" else split.val, tokenizer, seq_len, max_tokens)
    except ValueError as err:
        raise ValueError(f"{name} split ({split.describe(side)}): {err}") from None
