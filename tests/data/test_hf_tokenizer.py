"""Hugging Face ``tokenizer.json`` corpora and pre-tokenized, memory-mapped token files.

Oracle: the ``tokenizers`` library itself on a tiny byte-level BPE ``tokenizer.json`` trained in
the test (no download): packed streams must be its ids of each document followed by EOS. A corpus
pre-tokenized with :func:`pretokenize` must give exactly the samples of tokenizing the text
directly (same split, caps included), read from the file: no tokenizer call, the file's dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_moe.data import HFTokenizer, build_datasets, is_token_directory, pretokenize, read_token_split
from lightning_moe.lit import TextDataModule

tokenizers = pytest.importorskip("tokenizers", reason="the hf and test extras install tokenizers")

TEXTS = {f"doc{i:02d}.txt": f"def function_{i}(x):\n    return x * {i} + {i * i}  # number {i}\n" * (3 + i % 4)
         for i in range(24)}


def _tokenizer_json(path: Path, special=("<pad>", "<bos>", "<eos>")) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TEXTS.values(), trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


@pytest.fixture
def corpus(tmp_path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    for name, text in TEXTS.items():
        (root / name).write_text(text, encoding="utf-8")
    return root


@pytest.fixture
def tokenizer_file(tmp_path) -> Path:
    return _tokenizer_json(tmp_path / "tok")


def test_encode_equals_the_tokenizers_library(tokenizer_file):
    ours = HFTokenizer(tokenizer_file)
    theirs = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    text = TEXTS["doc03.txt"]
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids
    assert ours.decode(ours.encode(text)) == text
    assert ours.eos_id == theirs.token_to_id("<eos>") and ours.vocab_size == 300
    assert HFTokenizer(tokenizer_file.parent).path == tokenizer_file  # the model directory works too


def test_eos_comes_from_config_json_then_names(tmp_path, tokenizer_file):
    (tokenizer_file.parent / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert HFTokenizer(tokenizer_file.parent).eos_id == 1
    assert HFTokenizer(tokenizer_file, eos_token="<pad>").eos_id == 0
    plain = _tokenizer_json(tmp_path / "plain", special=("[PAD]",))
    with pytest.raises(ValueError, match="no end-of-document token found"):
        HFTokenizer(plain)
    with pytest.raises(ValueError, match=r"eos_token='<nope>' is not in the vocabulary"):
        HFTokenizer(tokenizer_file, eos_token="<nope>")
    with pytest.raises(FileNotFoundError, match=r"give a tokenizer\.json file"):
        HFTokenizer(tmp_path / "missing")


def test_packed_stream_is_the_tokenizers_ids_with_eos(corpus, tokenizer_file):
    tokenizer = HFTokenizer(tokenizer_file)
    theirs = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    train, val = build_datasets(corpus, seq_len=16, val_fraction=0.0, tokenizer=tokenizer)
    assert val is None
    expected = []
    for name in sorted(TEXTS):
        expected += [*theirs.encode(TEXTS[name], add_special_tokens=False).ids, tokenizer.eos_id]
    assert train.tokens.tolist() == expected


@pytest.mark.parametrize("max_tokens", [None, 700])
def test_pretokenized_corpus_gives_the_samples_of_the_text(corpus, tokenizer_file, tmp_path, max_tokens, monkeypatch):
    tokenizer = HFTokenizer(tokenizer_file)
    direct = build_datasets(corpus, seq_len=16, val_fraction=0.2, max_tokens=max_tokens, tokenizer=tokenizer)
    out = pretokenize(corpus, tmp_path / "tokens", tokenizer, val_fraction=0.2)
    assert is_token_directory(out) and not is_token_directory(corpus)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("a pre-tokenized corpus must not be tokenized again")

    monkeypatch.setattr(HFTokenizer, "encode", no_tokenizing)
    read = build_datasets(out, seq_len=16, val_fraction=0.2, max_tokens=max_tokens)
    for ours, theirs in zip(read, direct):
        assert ours.tokens.dtype == torch.uint16  # the file's own ids, memory-mapped
        assert len(ours) == len(theirs) and ours.num_documents == theirs.num_documents
        assert ours.tokens.tolist() == theirs.tokens.tolist()
        for index in (0, len(theirs) - 1):
            for got, want in zip(ours[index], theirs[index]):
                assert got.dtype == torch.int64 and torch.equal(got, want)
    tokens, offsets = read_token_split(out, "train")
    assert offsets[0] == 0 and offsets[-1] == len(tokens)
    assert (tokens[offsets[1:] - 1] == tokenizer.eos_id).all()  # every document ends with EOS


def test_pretokenized_corpus_refuses_another_split_and_a_truncated_file(corpus, tokenizer_file, tmp_path):
    out = pretokenize(corpus, tmp_path / "tokens", HFTokenizer(tokenizer_file), val_fraction=0.2)
    with pytest.raises(ValueError, match=r"pre-tokenized with val_fraction=0.2, not 0.1"):
        build_datasets(out, seq_len=16, val_fraction=0.1)
    data = (out / "train.bin").read_bytes()
    (out / "train.bin").write_bytes(data[:-2])
    with pytest.raises(ValueError, match="the directory is incomplete or was changed"):
        build_datasets(out, seq_len=16, val_fraction=0.2)


def test_datamodule_uses_the_tokenizer_and_token_files(corpus, tokenizer_file, tmp_path):
    module = TextDataModule(source=str(corpus), seq_len=16, batch_size=2, val_fraction=0.2,
                            tokenizer=str(tokenizer_file.parent))
    module.setup("fit")
    assert module.vocab_size == 300
    tokens_dir = pretokenize(corpus, tmp_path / "tokens", module.tokenizer, val_fraction=0.2)
    pre = TextDataModule(source=str(tokens_dir), seq_len=16, batch_size=2, val_fraction=0.2)
    pre.setup("fit")
    assert pre.vocab_size == 300
    assert pre.train_set.tokens.tolist() == module.train_set.tokens.tolist()
    inputs, targets = next(iter(pre.val_dataloader()))
    assert inputs.shape == targets.shape == (2, 16)
