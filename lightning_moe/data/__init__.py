"""Text data: byte tokenizer (no download) or a Hugging Face ``tokenizer.json``, corpora, packed datasets.

Core code (docs/architecture.md §1): no ``lightning`` and no ``torch.distributed`` collectives here;
the data-parallel rank and size are arguments. :mod:`lightning_moe.data.loading` has the samplers
that deal the map-style datasets over data-parallel replicas (training resumable mid-epoch,
validation without drops or repeats); :func:`split_corpus` splits a corpus into training and
validation (by document, or one document at a line boundary).

>>> from lightning_moe.data import ByteTokenizer, build_datasets
>>> train, val = build_datasets(None, seq_len=128, val_fraction=0.05, max_tokens=100_000)
>>> inputs, targets = train[0]  # int64 [128] each; targets are inputs shifted by one

:class:`HFTokenizer` reads a ``tokenizer.json`` (the ``hf`` extra); :func:`pretokenize` writes a
corpus once as memory-mapped token files, which ``build_datasets`` then reads without tokenizing.
"""

from lightning_moe.data.files import (
    SPLIT_BUCKETS,
    TextFiles,
    is_token_directory,
    is_validation_document,
    stdlib_corpus,
    stdlib_dir,
)
from lightning_moe.data.hf_tokenizer import HFTokenizer
from lightning_moe.data.split import CorpusSplit, TextPart, split_corpus
from lightning_moe.data.text import PackedTokenDataset, build_datasets
from lightning_moe.data.token_files import pretokenize, read_token_split
from lightning_moe.data.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "SPLIT_BUCKETS",
    "ByteTokenizer",
    "CorpusSplit",
    "HFTokenizer",
    "PackedTokenDataset",
    "TextFiles",
    "TextPart",
    "Tokenizer",
    "build_datasets",
    "is_token_directory",
    "is_validation_document",
    "pretokenize",
    "read_token_split",
    "split_corpus",
    "stdlib_corpus",
    "stdlib_dir",
]
