"""Text corpora and packed datasets: file discovery, document split, packing, caps and errors."""

from __future__ import annotations

import pickle
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from lightning_moe.data import (
    SPLIT_BUCKETS,
    ByteTokenizer,
    PackedTokenDataset,
    TextFiles,
    build_datasets,
    is_validation_document,
    pretokenize,
    split_corpus,
    stdlib_corpus,
    stdlib_dir,
)
from lightning_moe.lit import TextDataModule

TOK = ByteTokenizer()
EOS = TOK.eos_id
# Small enough that every stdlib build below reads a handful of files (seconds in all).
STDLIB_MAX_TOKENS = 20_000


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def _stream(docs: list[str]) -> list[int]:
    return [t for doc in docs if doc for t in [*TOK.encode(doc), EOS]]


def _samples(dataset: PackedTokenDataset) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [dataset[i] for i in range(len(dataset))]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    files = {f"doc{i:02d}.txt": f"document {i}: " + "héllo 😀 " * (i + 1) for i in range(40)}
    files |= {"nested/deeper/notes.txt": "nested text", "skip.md": "# markdown", "empty.txt": ""}
    return _write(tmp_path / "corpus", files)


@pytest.fixture(scope="module")
def stdlib_files() -> list[Path]:
    try:
        return stdlib_corpus()
    except FileNotFoundError as err:
        pytest.skip(f"the Python standard library sources are not on this machine: {err}")


# --- packing ------------------------------------------------------------------------------------


def test_sample_shapes_dtypes_and_shift():
    docs = ["abc", "", "defgh", "ijklmnopq"]
    ds = PackedTokenDataset(docs, TOK, seq_len=4)
    stream = _stream(docs)
    assert ds.tokens.tolist() == stream  # each non-empty document followed by EOS
    assert ds.num_documents == 3 and ds.num_tokens == len(stream) == 20
    assert len(ds) == 20 // 5
    for inputs, targets in _samples(ds):
        assert inputs.shape == targets.shape == (4,)
        assert inputs.dtype == targets.dtype == torch.int64
        assert torch.equal(inputs[1:], targets[:-1])


def test_samples_cover_the_stream_without_overlap():
    docs = [f"text number {i} " * (i % 5 + 1) for i in range(30)]
    ds = PackedTokenDataset(docs, TOK, seq_len=7)
    chunks = [torch.cat([inputs, targets[-1:]]) for inputs, targets in _samples(ds)]
    assert all(len(c) == 8 for c in chunks)
    assert torch.cat(chunks).tolist() == _stream(docs)[: len(ds) * 8]
    assert ds.num_tokens - len(ds) * 8 < 8  # only a tail shorter than one sample is dropped
    last_inputs, _ = ds[-1]
    assert torch.equal(last_inputs, ds[len(ds) - 1][0])


def test_index_out_of_range():
    ds = PackedTokenDataset(["abcdefgh"], TOK, seq_len=2)
    assert len(ds) == 3
    with pytest.raises(IndexError, match="sample index 3 is out of range for 3 samples"):
        ds[3]
    with pytest.raises(IndexError, match="sample index -4"):
        ds[-4]


def test_max_tokens_caps_the_stream_and_stops_reading():
    read: list[int] = []

    def docs():
        for i in range(100):
            read.append(i)
            yield "x" * 9  # 10 tokens with its EOS

    full = PackedTokenDataset(["x" * 9] * 100, TOK, seq_len=4)
    capped = PackedTokenDataset(docs(), TOK, seq_len=4, max_tokens=35)
    assert capped.num_tokens == 35 and capped.max_tokens == 35
    assert torch.equal(capped.tokens, full.tokens[:35])
    assert len(capped) == 7
    assert read == [0, 1, 2, 3]  # documents past the cap are never produced


def test_any_tokenizer_with_encode_and_eos_id():
    class CharTokenizer:
        eos_id = 0

        def encode(self, text):
            return [ord(c) for c in text]

    ds = PackedTokenDataset(["ab", "cd"], CharTokenizer(), seq_len=2)
    assert ds.tokens.tolist() == [97, 98, 0, 99, 100, 0]
    assert [s[0].tolist() for s in _samples(ds)] == [[97, 98], [99, 100]]


def test_dataloader_and_distributed_sampler_split_the_samples():
    ds = PackedTokenDataset([f"doc {i} " * 7 for i in range(20)], TOK, seq_len=8)
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=0, drop_last=True)
        seen.append(list(sampler))
        inputs, targets = next(iter(DataLoader(ds, batch_size=3, sampler=sampler)))
        assert inputs.shape == targets.shape == (3, 8) and inputs.dtype == torch.int64
    assert not set(seen[0]) & set(seen[1])
    restored = pickle.loads(pickle.dumps(ds))  # DataLoader workers under spawn
    assert torch.equal(restored.tokens, ds.tokens) and len(restored) == len(ds)


@pytest.mark.parametrize("seq_len", [0, -1, 1.5, True, None])
def test_seq_len_must_be_positive_int(seq_len):
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        PackedTokenDataset(["abc"], TOK, seq_len=seq_len)
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        build_datasets(None, seq_len=seq_len, val_fraction=0.1, max_tokens=1000)


@pytest.mark.parametrize("max_tokens", [0, -5, 2.0])
def test_max_tokens_must_be_positive_int(max_tokens):
    with pytest.raises(ValueError, match="max_tokens must be a positive int or None"):
        PackedTokenDataset(["abc"], TOK, seq_len=1, max_tokens=max_tokens)


def test_corpus_smaller_than_one_sample():
    with pytest.raises(
        ValueError,
        match=r"the corpus has 4 tokens \(1 non-empty documents\), fewer than one sample of seq_len \+ 1 = 5",
    ):
        PackedTokenDataset(["abc", ""], TOK, seq_len=4)
    with pytest.raises(
        ValueError, match=r"has 6 tokens .*capped at max_tokens=6\), fewer than .* = 11 tokens"
    ):
        PackedTokenDataset(["a" * 100], TOK, seq_len=10, max_tokens=6)
    with pytest.raises(ValueError, match=r"has 0 tokens \(0 non-empty"):
        PackedTokenDataset([], TOK, seq_len=1)


# --- file discovery -----------------------------------------------------------------------------


def test_directory_with_glob_pattern_is_recursive_and_sorted(corpus):
    files = TextFiles.discover(corpus)  # default pattern "*.txt"
    assert files.root == corpus
    assert "nested/deeper/notes.txt" in files.relative_paths and "skip.md" not in files.relative_paths
    assert len(files) == 42
    assert list(files.relative_paths) == sorted(files.relative_paths, key=lambda p: Path(p).parts)
    assert files.paths[0] == corpus / files.relative_paths[0]
    md = TextFiles.discover(corpus, pattern="*.md")
    assert md.relative_paths == ("skip.md",) and list(md) == ["# markdown"]


def test_order_is_by_path_components(tmp_path):
    root = _write(tmp_path, {"b.txt": "b", "a-b.txt": "ab", "a/z.txt": "az", "A.txt": "A"})
    assert TextFiles.discover(root).relative_paths == ("A.txt", "a/z.txt", "a-b.txt", "b.txt")


def test_single_file_and_list_of_paths(corpus):
    single = TextFiles.discover(corpus / "doc03.txt")
    assert single.root == corpus and single.relative_paths == ("doc03.txt",)
    assert single[0] == (corpus / "doc03.txt").read_text(encoding="utf-8")
    listed = TextFiles.discover([str(corpus / "nested"), corpus / "doc01.txt", corpus / "doc01.txt"])
    assert listed.root == corpus
    assert listed.relative_paths == ("doc01.txt", "nested/deeper/notes.txt")  # sorted, duplicate once
    assert isinstance(listed[:1], TextFiles) and listed[:1].relative_paths == ("doc01.txt",)
    ds = PackedTokenDataset(single, TOK, seq_len=4)
    assert ds.tokens.tolist() == _stream([single[0]])


def test_files_are_read_as_utf8_with_replacement(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"ok\xff\r\nend")
    assert TextFiles.discover(path)[0] == "ok\ufffd\r\nend"  # invalid byte replaced, no newline translation


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"text source {missing} does not exist"):
        TextFiles.discover(missing)
    with pytest.raises(FileNotFoundError, match="nope does not exist"):
        build_datasets(str(missing), seq_len=8, val_fraction=0.1, max_tokens=None)
    with pytest.raises(FileNotFoundError, match="nope does not exist"):
        TextFiles.discover([tmp_path, missing])


def test_directory_without_matches(corpus):
    with pytest.raises(FileNotFoundError, match=rf"no files matching '\*\.rst' under directory {corpus}"):
        TextFiles.discover(corpus, pattern="*.rst")


def test_empty_list_of_paths():
    with pytest.raises(ValueError, match="source is an empty list of paths"):
        TextFiles.discover([])


# --- train / validation split -------------------------------------------------------------------


def test_split_is_disjoint_by_document_and_follows_the_checksum(corpus):
    files = TextFiles.discover(corpus)
    train, val = files.split(0.25)
    assert set(train.relative_paths).isdisjoint(val.relative_paths)
    assert sorted(train.relative_paths + val.relative_paths) == sorted(files.relative_paths)
    for rel in files.relative_paths:
        expected = zlib.crc32(rel.encode()) % SPLIT_BUCKETS < 250
        assert is_validation_document(rel, 0.25) is expected
        assert (rel in val.relative_paths) is expected
    assert 0 < len(val) < len(files)


def test_split_is_stable_across_locations_and_added_files(corpus, tmp_path):
    train, val = TextFiles.discover(corpus).split(0.3)
    moved = shutil.copytree(corpus, tmp_path / "elsewhere" / "copy")
    # Same files elsewhere: the same datasets, token for token.
    for a, b in zip(
        build_datasets(corpus, seq_len=16, val_fraction=0.3, max_tokens=None),
        build_datasets(moved, seq_len=16, val_fraction=0.3, max_tokens=None),
    ):
        assert torch.equal(a.tokens, b.tokens)
    # More files: no existing document changes side.
    _write(moved, {f"extra{i}.txt": "more" for i in range(10)})
    train2, val2 = TextFiles.discover(moved).split(0.3)
    assert set(val.relative_paths) <= set(val2.relative_paths)
    assert set(train.relative_paths) <= set(train2.relative_paths)


def test_small_corpora_still_get_one_document_each_side(tmp_path):
    # crc32 % 1000: "a.txt" -> 66, "b.txt" -> 346 (crc32 is fixed by its specification).
    root = _write(tmp_path, {"a.txt": "a" * 50, "b.txt": "b" * 50})
    files = TextFiles.discover(root)
    # A fraction that selects no document by checksum: the smallest checksum (b.txt) goes to validation.
    assert files.split(0.05) == (files[:1], files[1:])
    # A fraction that selects both: the first document stays in training.
    train, val = files.split(0.5)
    assert train.relative_paths == ("a.txt",) and val.relative_paths == ("b.txt",)
    train, val = files.split(0.1)  # 66 < 100 <= 346: a.txt by checksum
    assert train.relative_paths == ("b.txt",) and val.relative_paths == ("a.txt",)


def test_split_errors(corpus):
    files = TextFiles.discover(corpus)
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\)"):
            files.split(bad)
    with pytest.raises(ValueError, match=r"val_fraction=0.1 needs at least 2 documents .* has 1"):
        TextFiles.discover(corpus / "doc00.txt").split(0.1)
    train, val = TextFiles.discover(corpus / "doc00.txt").split(0.0)
    assert len(train) == 1 and len(val) == 0


def test_one_file_is_split_by_lines_with_the_default_val_fraction(tmp_path):
    text = "".join(f"line {i}: " + "héllo " * (i % 7) + "\n" for i in range(200))
    path = _write(tmp_path, {"only.txt": text}) / "only.txt"
    train, val = build_datasets(path, seq_len=16)  # the default val_fraction, 0.05
    # Oracle: the file. Validation is its last lines, the cut the line start nearest 95% of it.
    starts = [i + 1 for i, char in enumerate(text[:-1]) if char == "\n"]
    cut = min(starts, key=lambda i: abs(i - round(0.95 * len(text))))
    assert train.tokens.tolist() == _stream([text[:cut]]) and val.tokens.tolist() == _stream([text[cut:]])
    assert train.num_documents == val.num_documents == 1
    split = split_corpus(path, 0.05)
    assert (split.by, split.num_documents) == ("lines", 1) and list(split.train) + list(split.val) == [text[:cut], text[cut:]]
    assert TextDataModule(str(path), seq_len=16).split().by == "lines"


def test_one_line_is_split_by_characters_and_a_too_small_part_is_named(tmp_path):
    root = _write(tmp_path, {"line.txt": "x" * 400, "tiny.txt": "y"})
    split = split_corpus(root / "line.txt", 0.1)
    assert split.by == "characters" and (list(split.train), list(split.val)) == (["x" * 360], ["x" * 40])
    with pytest.raises(ValueError, match=r"validation split \(characters \[360:\] of .*line.txt\): the corpus has 41"):
        build_datasets(root / "line.txt", seq_len=64, val_fraction=0.1)
    with pytest.raises(ValueError, match=r"tiny.txt is the only document and holds 1 characters: .* or set val_fraction=0"):
        split_corpus(root / "tiny.txt", 0.05)


def test_pretokenize_splits_one_file_as_build_datasets_does(tmp_path):
    path = _write(tmp_path, {"only.txt": "".join(f"row {i}\n" for i in range(300))}) / "only.txt"
    from_text = build_datasets(path, seq_len=8)
    from_tokens = build_datasets(pretokenize(path, tmp_path / "tokens"), seq_len=8)
    for a, b in zip(from_text, from_tokens):
        assert a.tokens.tolist() == b.tokens.tolist()


# --- build_datasets over a directory ------------------------------------------------------------


def test_build_datasets_from_directory(corpus):
    train, val = build_datasets(str(corpus), seq_len=16, val_fraction=0.25, max_tokens=None)
    files = TextFiles.discover(corpus)
    train_files, val_files = files.split(0.25)
    assert train.tokens.tolist() == _stream(list(train_files))
    assert val.tokens.tolist() == _stream(list(val_files))
    inputs, targets = train[0]
    assert inputs.shape == (16,) and targets.dtype == torch.int64


def test_build_datasets_without_validation(corpus):
    train, val = build_datasets(corpus / "doc39.txt", seq_len=8, val_fraction=0.0, max_tokens=None)
    assert val is None and train.num_documents == 1


def test_build_datasets_max_tokens_budget(corpus):
    train, val = build_datasets(corpus, seq_len=16, val_fraction=0.1, max_tokens=500)
    assert val.num_tokens == 50 and train.num_tokens == 450
    train, val = build_datasets(corpus, seq_len=99, val_fraction=0.1, max_tokens=500)
    assert val.num_tokens == 100 and train.num_tokens == 400  # validation gets at least one sample
    with pytest.raises(
        ValueError, match=r"max_tokens=150 is too small: validation takes 100 tokens .* >= 200"
    ):
        build_datasets(corpus, seq_len=99, val_fraction=0.1, max_tokens=150)
    # The suggested minimum accounts for validation growing with max_tokens.
    with pytest.raises(ValueError, match=r"validation takes 450 tokens .* use max_tokens >= 996$"):
        build_datasets(corpus, seq_len=99, val_fraction=0.9, max_tokens=500)
    train, val = build_datasets(corpus, seq_len=99, val_fraction=0.9, max_tokens=996)
    assert (train.num_tokens, val.num_tokens) == (100, 896)
    with pytest.raises(ValueError, match="max_tokens=995 is too small"):
        build_datasets(corpus, seq_len=99, val_fraction=0.9, max_tokens=995)


def test_build_datasets_names_the_split_that_is_too_small(tmp_path):
    root = _write(tmp_path, {f"f{i}.txt": "x" * (1000 if i else 1) for i in range(2)})
    with pytest.raises(ValueError, match=r"(training|validation) split \(1 files under .*\): the corpus has"):
        build_datasets(root, seq_len=64, val_fraction=0.5, max_tokens=None)


# --- the standard-library corpus ----------------------------------------------------------------


def test_stdlib_corpus_is_found_and_filtered(stdlib_files):
    root = stdlib_dir()
    assert len(stdlib_files) > 100
    relative = [p.relative_to(root) for p in stdlib_files]
    assert relative == sorted(relative, key=lambda p: p.parts)
    assert all(p.suffix == ".py" and p.is_file() for p in stdlib_files)
    excluded = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    assert not any(excluded & set(p.parts[:-1]) for p in relative)
    assert not any(p.name.startswith("_sysconfigdata") for p in relative)
    assert Path("os.py") in relative
    assert stdlib_corpus(max_files=5) == stdlib_files[:5]
    with pytest.raises(ValueError, match="max_files must be a positive int or None"):
        stdlib_corpus(max_files=0)


def test_stdlib_datasets_are_deterministic_and_split_by_document(stdlib_files):
    first = build_datasets(None, seq_len=64, val_fraction=0.05, max_tokens=STDLIB_MAX_TOKENS)
    second = build_datasets(None, seq_len=64, val_fraction=0.05, max_tokens=STDLIB_MAX_TOKENS, tokenizer=TOK)
    for a, b in zip(first, second):
        assert torch.equal(a.tokens, b.tokens) and len(a) == len(b) > 0
        assert all(torch.equal(x[0], y[0]) for x, y in zip(_samples(a), _samples(b)))
    train, val = first
    assert train.num_tokens + val.num_tokens == STDLIB_MAX_TOKENS
    assert val.num_tokens == STDLIB_MAX_TOKENS * 5 // 100
    root = stdlib_dir()
    files = TextFiles(root, tuple(p.relative_to(root).as_posix() for p in stdlib_files))
    train_files, val_files = files.split(0.05)
    assert set(train_files.relative_paths).isdisjoint(val_files.relative_paths)
    assert 0.02 < len(val_files) / len(files) < 0.1
    # The capped streams are the prefixes of each side's documents, in order.
    assert train.tokens.tolist() == _stream(list(train_files[: train.num_documents]))[: train.num_tokens]
    assert val.tokens.tolist() == _stream(list(val_files[: val.num_documents]))[: val.num_tokens]
    assert "\ufffd" not in TOK.decode(train.tokens[:2000])
