"""ByteTokenizer: exact round trip for any text, special tokens, vocabulary size."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_moe.data import ByteTokenizer

# Any string that has a UTF-8 encoding: every code point except the lone surrogates.
UNICODE_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)))


@pytest.fixture
def tok() -> ByteTokenizer:
    return ByteTokenizer()


@settings(deadline=None, max_examples=200)
@given(text=UNICODE_TEXT, add_bos=st.booleans(), add_eos=st.booleans())
def test_round_trip_any_unicode(text, add_bos, add_eos):
    tok = ByteTokenizer()
    ids = tok.encode(text, add_bos=add_bos, add_eos=add_eos)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids, dtype=torch.int64)) == text
    assert torch.equal(tok.encode_tensor(text, add_bos=add_bos, add_eos=add_eos), torch.tensor(ids))


@pytest.mark.parametrize(
    "text", ["", "a", "héllo wörld", "日本語テキスト", "😀👍🏽 family: 👨‍👩‍👧", "\x00\n\t\r\n"]
)
def test_round_trip_examples(tok, text):
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_emoji_is_four_bytes(tok):
    assert tok.encode("😀") == [0xF0, 0x9F, 0x98, 0x80]


def test_empty_string(tok):
    assert tok.encode("") == []
    assert tok.decode([]) == ""
    assert tok.encode("", add_bos=True, add_eos=True) == [tok.bos_id, tok.eos_id]
    empty = tok.encode_tensor("")
    assert empty.dtype == torch.int64 and empty.shape == (0,)


def test_special_tokens(tok):
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (256, 257, 258)
    assert dict(tok.special_tokens) == {"pad": 256, "bos": 257, "eos": 258}
    ids = tok.encode("hi", add_bos=True, add_eos=True)
    assert ids == [tok.bos_id, ord("h"), ord("i"), tok.eos_id]
    # Specials are skipped wherever they appear, and never come from text.
    assert tok.decode([tok.pad_id, *ids, tok.pad_id, tok.eos_id]) == "hi"
    assert tok.encode("<eos>") == list(b"<eos>")
    with pytest.raises(TypeError):
        tok.special_tokens["unk"] = 259


def test_decode_replaces_invalid_utf8(tok):
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"
    # A code point cut in half by the end of a sample.
    assert tok.decode(tok.encode("😀")[:2]) == "\ufffd"


@pytest.mark.parametrize("bad", [-1, 259, 1000])
def test_decode_rejects_ids_outside_vocab(tok, bad):
    with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary \[0, 259\)"):
        tok.decode([65, bad])


def test_decode_rejects_non_1d_or_float_tensors(tok):
    with pytest.raises(ValueError, match=r"1-D integer tensor, got shape \(1, 2\)"):
        tok.decode(torch.tensor([[65, 66]]))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        tok.decode(torch.tensor([65.0]))


def test_encode_rejects_non_str(tok):
    with pytest.raises(TypeError, match="encode expects a str, got bytes"):
        tok.encode(b"abc")
    with pytest.raises(TypeError, match="encode_tensor expects a str, got int"):
        tok.encode_tensor(3)


def test_vocab_size(tok):
    assert tok.vocab_size == 259
    assert max(tok.special_tokens.values()) == tok.vocab_size - 1


@pytest.mark.parametrize(("multiple", "expected"), [(1, 259), (8, 264), (64, 320), (128, 384), (259, 259)])
def test_padded_vocab_size(tok, multiple, expected):
    assert tok.padded_vocab_size(multiple) == expected
    assert tok.padded_vocab_size(multiple) % multiple == 0


def test_padded_vocab_size_default_is_64(tok):
    assert tok.padded_vocab_size() == 320


@pytest.mark.parametrize("multiple", [0, -8, 2.5, True])
def test_padded_vocab_size_rejects_bad_multiple(tok, multiple):
    with pytest.raises(ValueError, match="multiple must be a positive int"):
        tok.padded_vocab_size(multiple)


def test_equal_hashable_picklable(tok):
    clone = pickle.loads(pickle.dumps(tok))
    assert clone == tok == ByteTokenizer() and hash(clone) == hash(tok)
    assert clone.encode("x", add_eos=True) == [ord("x"), 258]
    assert repr(tok) == "ByteTokenizer(vocab_size=259)"
