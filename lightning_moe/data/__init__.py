"""Byte-level text data with no download: tokenizer, text corpora and packed next-token datasets.

Core code (docs/architecture.md §1): no ``lightning`` and no ``torch.distributed`` here; Lightning's
``DistributedSampler`` shards the map-style datasets over data-parallel replicas.

>>> from lightning_moe.data import ByteTokenizer, build_datasets
>>> train, val = build_datasets(None, seq_len=128, val_fraction=0.05, max_tokens=100_000)
>>> inputs, targets = train[0]  # int64 [128] each; targets are inputs shifted by one
"""

from lightning_moe.data.files import (
    SPLIT_BUCKETS,
    TextFiles,
    is_validation_document,
    stdlib_corpus,
    stdlib_dir,
)
from lightning_moe.data.text import PackedTokenDataset, Tokenizer, build_datasets
from lightning_moe.data.tokenizer import ByteTokenizer

__all__ = [
    "SPLIT_BUCKETS",
    "ByteTokenizer",
    "PackedTokenDataset",
    "TextFiles",
    "Tokenizer",
    "build_datasets",
    "is_validation_document",
    "stdlib_corpus",
    "stdlib_dir",
]
