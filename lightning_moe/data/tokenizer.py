"""`ByteTokenizer`: UTF-8 bytes as tokens, plus three special tokens; nothing to download.

Ids ``0..255`` are the bytes of the UTF-8 encoding of the text, so every string round-trips
exactly (``decode(encode(s)) == s``) and there is no unknown token. The special tokens come after
the bytes: ``pad = 256``, ``bos = 257``, ``eos = 258``. They are never produced from text (the
string ``"<eos>"`` encodes as its five bytes); only ``add_bos`` / ``add_eos`` and the datasets
insert them.

Vocabulary size: :attr:`ByteTokenizer.vocab_size` is the exact number of ids, ``259``, the value
to validate ids against and to size an output layer whose logits must all be reachable. For an
embedding or output table with GEMM-friendly shapes use :meth:`ByteTokenizer.padded_vocab_size`,
which rounds up to a multiple (default 64: ``320``), like Megatron's
``--make-vocab-size-divisible-by``. The padding ids are never produced and never targets; a model
trained on them learns to give them vanishing probability.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["NUM_BYTES", "STREAM_DTYPE", "ByteTokenizer", "Tokenizer", "encode_document"]

NUM_BYTES = 256
"""Ids below this are raw bytes; special tokens start here."""

_SPECIAL_NAMES = ("pad", "bos", "eos")


class ByteTokenizer:
    """Byte-level tokenizer: UTF-8 bytes (ids 0..255) and the specials ``pad``, ``bos``, ``eos``.

    Stateless and picklable; every instance is equal, so it can be built from a LightningCLI
    config with no arguments.
    """

    def __init__(self) -> None:
        self._special_tokens = MappingProxyType(
            {name: NUM_BYTES + i for i, name in enumerate(_SPECIAL_NAMES)}
        )

    @property
    def pad_id(self) -> int:
        """Padding id (256), for batches of unequal lengths; never a training target."""
        return self._special_tokens["pad"]

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id (257)."""
        return self._special_tokens["bos"]

    @property
    def eos_id(self) -> int:
        """End-of-sequence id (258); the datasets put it after every document."""
        return self._special_tokens["eos"]

    @property
    def special_tokens(self) -> Mapping[str, int]:
        """Read-only mapping from special-token name to id: ``{"pad": 256, "bos": 257, "eos": 258}``."""
        return self._special_tokens

    @property
    def vocab_size(self) -> int:
        """Exact number of ids: 256 bytes plus the special tokens (259). Not padded."""
        return NUM_BYTES + len(self._special_tokens)

    def padded_vocab_size(self, multiple: int = 64) -> int:
        """:attr:`vocab_size` rounded up to a multiple of ``multiple`` (64 gives 320).

        Use it for embedding / output tables; under tensor parallelism pass
        ``multiple * tensor_parallel_size`` so each shard is a multiple too (as Megatron does).
        """
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"multiple must be a positive int, got {multiple!r}")
        return -(-self.vocab_size // multiple) * multiple

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids, optionally with ``bos`` first and ``eos`` last.

        Lone surrogates (which have no UTF-8 encoding) raise ``UnicodeEncodeError``.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_tensor(self, text: str, add_bos: bool = False, add_eos: bool = False) -> torch.Tensor:
        """:meth:`encode` as a 1-D int64 tensor, built without a Python list (fast for large texts)."""
        if not isinstance(text, str):
            raise TypeError(f"encode_tensor expects a str, got {type(text).__name__}")
        data = text.encode("utf-8")
        body = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
            if data
            else torch.empty(0, dtype=torch.int64)
        )
        parts = ([torch.tensor([self.bos_id])] if add_bos else []) + [body]
        if add_eos:
            parts.append(torch.tensor([self.eos_id]))
        return torch.cat(parts) if len(parts) > 1 else body

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """Text of ``ids``: special tokens are skipped, invalid UTF-8 becomes U+FFFD.

        ``ids`` is an iterable of ints or a 1-D integer tensor; an id outside ``[0, vocab_size)``
        raises ``ValueError``.
        """
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
                raise ValueError(
                    f"decode expects a 1-D integer tensor, got shape {tuple(ids.shape)} dtype {ids.dtype}"
                )
            ids = ids.tolist()
        data = bytearray()
        for token in ids:
            if 0 <= token < NUM_BYTES:
                data.append(token)
            elif not NUM_BYTES <= token < self.vocab_size:
                raise ValueError(f"token id {token} is outside the vocabulary [0, {self.vocab_size})")
        return data.decode("utf-8", errors="replace")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"

    def __reduce__(self):
        # MappingProxyType is not picklable; the tokenizer has no state to save.
        return (type(self), ())


STREAM_DTYPE = torch.int32
"""The dtype of encoded token streams: stored compactly and widened per sample; vocabularies never approach 2**31."""


class Tokenizer(Protocol):
    """What the datasets need from a tokenizer (:class:`ByteTokenizer` is one)."""

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> Sequence[int] | Tensor: ...


def encode_document(tokenizer: Tokenizer, text: str) -> Tensor:
    """``text``'s ids as a 1-D :data:`STREAM_DTYPE` tensor: the one encoding the datasets and ``pretokenize`` share."""
    # ByteTokenizer.encode_tensor skips the Python list of ints; any other tokenizer uses encode.
    encode_tensor = getattr(tokenizer, "encode_tensor", None)
    ids = encode_tensor(text) if callable(encode_tensor) else tokenizer.encode(text)
    ids = ids.to(STREAM_DTYPE) if isinstance(ids, Tensor) else torch.tensor(ids, dtype=STREAM_DTYPE)
    if ids.dim() != 1:
        raise ValueError(f"tokenizer.encode must return a 1-D sequence of ids, got shape {tuple(ids.shape)}")
    return ids
