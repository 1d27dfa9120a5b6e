"""`check_token_ids`: refuse token ids outside a vocabulary, naming the id, where it is and the fix.

An id outside ``[0, vocab_size)`` is never harmless: at TP=1 the embedding fails with torch's bare
``index out of range``, and under tensor parallelism the vocabulary-parallel embedding gives it an
all-zero row, so the model trains on it silently (its loss stays near ``ln V``). The check is one
comparison on the tensor's device and, only when some id is bad, one host read to name it; the
caller decides how often to pay the comparison's synchronisation (``bool(bad.any())``).
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["TokenIdError", "check_batch_token_ids", "check_token_ids", "vocab_problem"]


def vocab_problem(data_vocab: int, model_vocab: int) -> str:
    """The data's tokenizer emits more ids than the model's vocabulary holds: what to change."""
    return (
        f"The tokenizer emits {data_vocab} token ids but model.vocab_size={model_vocab}; set model.vocab_size >= "
        f"{data_vocab} (a multiple of 64 keeps tensor parallelism happy)."
    )


class TokenIdError(ValueError):
    """A batch holds a token id outside the vocabulary (the message names it, its position and the fix)."""


def check_token_ids(
    tokens: Tensor, vocab_size: int, what: str, ignore_index: int | None = None, hint: str = ""
) -> None:
    """Raise :class:`TokenIdError` if an entry of ``tokens`` is outside ``[0, vocab_size)``.

    Args:
        tokens: integer ids of any shape (e.g. a ``[B, S]`` batch); any device.
        vocab_size: the vocabulary the ids must fit (the model's ``vocab_size``, or the tokenizer's).
        what: names the tensor in the message, e.g. ``"training batch 3 inputs"``.
        ignore_index: a value allowed anyway (``-100`` for targets that are left out of the loss).
        hint: the fix to append to the message (default: one for a model's ``vocab_size``).

    The message names the first offending id (in row-major order), its index in ``tokens``, the
    smallest and largest id of the tensor, and ``vocab_size``.
    """
    bad = (tokens < 0) | (tokens >= vocab_size)
    if ignore_index is not None:
        bad &= tokens != ignore_index
    if not bool(bad.any()):  # the only host read when every id fits
        return
    position = tuple(int(i) for i in bad.nonzero()[0])
    value = int(tokens[position])
    kept = tokens if ignore_index is None else tokens[tokens != ignore_index]
    low, high = int(kept.min()), int(kept.max())
    fix = hint or (
        f"The ids must come from a tokenizer of at most vocab_size ids: set the model's vocab_size >= {high + 1} "
        "(a multiple of 64 keeps tensor parallelism happy), or fix the data / tokenizer that produced them."
    )
    raise TokenIdError(
        f"{what}: token id {value} at position {list(position)} (shape {list(tokens.shape)}) is outside the "
        f"vocabulary [0, vocab_size={vocab_size}); the ids range over [{low}, {high}]. {fix}"
    )



_DATA_HINT = (
    "The data module's tokenizer promises ids below {vocab}: a pre-tokenized corpus written with another "
    "tokenizer, or a tokenizer whose added tokens pass its vocab_size; tokenize the corpus again with the "
    "tokenizer the model trains with."
)


def check_batch_token_ids(batch: object, vocab_size: int, split: str) -> None:
    """:func:`check_token_ids` of every tensor of a data module's ``batch`` (``(inputs, targets)``, a
    tensor, or a list of tensors) against its tokenizer's ``vocab_size``; targets may be ``-100``
    (ignored), as padded evaluation rows are. ``split`` names the batch (``"training"`` ...)."""
    parts = list(batch) if isinstance(batch, (tuple, list)) else [batch]
    names = ["inputs", "targets"] if len(parts) == 2 else [f"tensor {i}" for i in range(len(parts))]
    for name, part in zip(names, parts):
        if isinstance(part, Tensor):
            check_token_ids(
                part, vocab_size, f"a {split} batch's {name}", ignore_index=-100 if name == "targets" else None,
                hint=_DATA_HINT.format(vocab=vocab_size),
            )
