"""Pre-tokenized corpora on disk: flat token files with document boundaries, memory-mapped.

:func:`pretokenize` tokenizes a text corpus once (any :class:`~lightning_moe.data.text.Tokenizer`,
e.g. :class:`~lightning_moe.data.hf_tokenizer.HFTokenizer`) and writes a directory::

    tokens.json      format, dtype, eos_id, vocab_size, tokenizer, val_fraction, per split its
                     token and document counts
    train.bin        the training documents' ids, each followed by EOS, one flat array
    train.idx        int64 offsets of each document's first token in train.bin, then its length
    val.bin, val.idx the same for validation (when val_fraction > 0)

The streams are exactly what :func:`~lightning_moe.data.build_datasets` builds from the text (same
document order and train/validation split), so :func:`read_token_split` (which
``build_datasets`` calls for such a directory) gives the same samples without tokenizing again.
Ids are ``uint16`` when the vocabulary fits, else ``int32``. Reading memory-maps the file
(``numpy.memmap``, copy-on-write: the file is never changed); a sample is copied out when indexed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_moe.data.files import TOKENS_META, is_token_directory
from lightning_moe.data.tokenizer import encode_document  # the datasets' own encoding: equal streams

__all__ = ["TOKENS_META", "is_token_directory", "pretokenize", "read_token_split"]

_FORMAT = "lightning_moe-tokens-v1"


def _write_split(documents: Iterable[str], tokenizer, path: Path, name: str, dtype: np.dtype) -> dict[str, int]:

    offsets, total = [0], 0
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    with open(path / f"{name}.bin", "wb") as handle:
        for text in documents:
            if not text:
                continue  # as the datasets do
            ids = encode_document(tokenizer, text).numpy().astype(dtype)
            ids.tofile(handle)
            eos.tofile(handle)
            total += len(ids) + 1
            offsets.append(total)
    np.asarray(offsets, dtype=np.int64).tofile(path / f"{name}.idx")
    return {"num_tokens": total, "num_documents": len(offsets) - 1}


def pretokenize(
    source, output: str | os.PathLike, tokenizer=None, val_fraction: float = 0.05, *, pattern: str = "*.txt"
) -> Path:
    """Tokenize the corpus ``source`` (as :func:`~lightning_moe.data.build_datasets` reads it) into ``output``.

    ``tokenizer`` defaults to the byte tokenizer. The split is fixed here (by document, or a single
    document cut at a line boundary: :func:`~lightning_moe.data.split_corpus`): reading the
    directory with another ``val_fraction`` is refused. Returns ``output``.
    """
    from lightning_moe.data.split import split_corpus
    from lightning_moe.data.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    split = split_corpus(source, val_fraction, pattern)
    train, val = split.train, split.val
    vocab = int(getattr(tokenizer, "vocab_size", 2**31 - 1))
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.int32)
    path = Path(output)
    path.mkdir(parents=True, exist_ok=True)
    splits = {"train": _write_split(train, tokenizer, path, "train", dtype)}
    if val_fraction > 0:
        splits["val"] = _write_split(val, tokenizer, path, "val", dtype)
    meta = {
        "format": _FORMAT, "dtype": dtype.name, "eos_id": tokenizer.eos_id, "vocab_size": vocab,
        "tokenizer": str(getattr(tokenizer, "path", type(tokenizer).__name__)), "val_fraction": val_fraction,
        "splits": splits,
    }
    (path / TOKENS_META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return path


def read_token_meta(path: str | os.PathLike) -> dict[str, Any]:
    """``tokens.json`` of the directory ``path``, checked for its format."""
    meta = json.loads((Path(path) / TOKENS_META).read_text(encoding="utf-8"))
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{path}/{TOKENS_META} has format {meta.get('format')!r}, expected {_FORMAT!r}.")
    return meta


def read_token_split(path: str | os.PathLike, split: str) -> tuple[Tensor, Tensor]:
    """``(tokens, document offsets)`` of ``split`` (``"train"`` or ``"val"``) of a :func:`pretokenize` directory.

    ``tokens`` is a 1-D tensor over the memory-mapped file (nothing read until indexed); the
    offsets (int64, one more than the documents) are read in full.
    """
    path = Path(path)
    meta = read_token_meta(path)
    if split not in meta["splits"]:
        raise ValueError(f"{path} has no {split!r} split (splits: {sorted(meta['splits'])}).")
    expected = meta["splits"][split]["num_tokens"]
    file = path / f"{split}.bin"
    dtype = np.dtype(meta["dtype"])
    size = file.stat().st_size if file.is_file() else -1
    if size != expected * dtype.itemsize:
        raise ValueError(
            f"{file} holds {size} bytes, but {TOKENS_META} records {expected} {dtype.name} tokens "
            f"({expected * dtype.itemsize} bytes): the directory is incomplete or was changed; run pretokenize again."
        )
    tokens = torch.from_numpy(np.memmap(file, dtype=dtype, mode="c")) if expected else torch.empty(0, dtype=torch.int32)
    offsets = torch.from_numpy(np.fromfile(path / f"{split}.idx", dtype=np.int64))
    return tokens, offsets
