"""`HFTokenizer`: a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library, the ``hf`` extra).

A model loaded from a Hugging Face directory trains on its own vocabulary: ``HFTokenizer(path)``
takes the ``tokenizer.json`` file or the model directory holding it. Text is encoded without the
tokenizer's post-processing (no BOS/EOS added per call): the datasets end each document with
:attr:`HFTokenizer.eos_id` themselves. The end-of-document token is, in order: ``eos_token``
if given, the directory's ``config.json`` ``eos_token_id``, else the first of the usual names
(``</s>``, ``<|endoftext|>``, ``<eos>``, ...) the vocabulary has; none found is an error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor

from lightning_moe.install_hints import install_hint

__all__ = ["HFTokenizer"]

TOKENIZER_FILE = "tokenizer.json"
_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "<｜end▁of▁sentence｜>", "<|im_end|>")


def _tokenizers():
    try:
        import tokenizers
    except ImportError as err:
        raise ImportError(
            f"Reading a Hugging Face tokenizer.json needs the tokenizers library: {install_hint('hf')}."
        ) from err
    return tokenizers


class HFTokenizer:
    """The ``tokenizer.json`` at ``path`` (the file, or a model directory containing it).

    Args:
        path: ``tokenizer.json`` or the directory that holds it.
        eos_token: the token ending each document (default: see the module docstring).
    """

    def __init__(self, path: str | os.PathLike, eos_token: str | None = None) -> None:
        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} does not exist: give a tokenizer.json file or the Hugging Face model directory holding one."
            )
        self.path = file
        tokenizers = _tokenizers()
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(file))
        except Exception as err:  # the Rust library raises a bare Exception naming no file
            raise ValueError(
                f"{file} is not a valid tokenizer.json ({' '.join(str(err).split())}); use the tokenizer.json "
                "of the model (transformers' tokenizer.save_pretrained writes one)."
            ) from err
        self._eos_id = self._find_eos(eos_token, file.parent / "config.json")

    def _find_eos(self, eos_token: str | None, config_file: Path) -> int:
        if eos_token is not None:
            token_id = self._tokenizer.token_to_id(eos_token)
            if token_id is None:
                raise ValueError(f"eos_token={eos_token!r} is not in the vocabulary of {self.path}.")
            return token_id
        if config_file.is_file():
            try:
                eos = json.loads(config_file.read_text(encoding="utf-8")).get("eos_token_id")
            except (ValueError, AttributeError) as err:  # JSONDecodeError is a ValueError
                raise ValueError(f"{config_file} is not a valid config.json: {err}.") from err
            eos = eos[0] if isinstance(eos, list) and eos else eos
            if isinstance(eos, int):
                return eos
        for name in _EOS_NAMES:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        raise ValueError(
            f"{self.path}: no end-of-document token found (no eos_token_id in config.json, none of "
            f"{', '.join(_EOS_NAMES)} in the vocabulary); pass eos_token=... (data.tokenizer_eos_token in YAML)."
        )

    @property
    def eos_id(self) -> int:
        """The id ending each document."""
        return self._eos_id

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can emit (its vocabulary with the added tokens); the model's must be at least this."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` (no special tokens added)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_tensor(self, text: str) -> Tensor:
        """:meth:`encode` as a 1-D int32 tensor."""
        return torch.tensor(self.encode(text), dtype=torch.int32)

    def decode(self, ids) -> str:
        """The text of ``ids`` (special tokens kept)."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"
