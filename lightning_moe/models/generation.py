"""`generate_tokens`: greedy or sampled continuation of a prompt with a language model, one device.

The loop is the plainest one that is exactly right: each new token runs the whole (cropped)
sequence through the model again, no key/value cache, so any model mapping ``[1, S]`` token ids
to ``[1, S, V]`` logits works unchanged (the reference :class:`~lightning_moe.models.MoETransformer`
included). Meant for looking at what a checkpoint learned (``lightning-moe generate``), not for
serving.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["generate_tokens", "next_token"]


def next_token(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> int:
    """The next token id from the last position's ``logits`` ``[V]``.

    ``temperature == 0``: the argmax (greedy; the first of equal maxima). Otherwise a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits (all when None),
    with ``generator`` (seeded: reproducible).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be a positive number of candidate tokens (or None for all), got {top_k}.")
    logits = logits.float()
    if temperature == 0:
        return int(logits.argmax())
    scaled = logits / temperature
    if top_k is not None and top_k < scaled.numel():
        threshold = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@torch.no_grad()
def generate_tokens(
    model: Callable[[Tensor], Tensor],
    prompt: Sequence[int] | Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
    eos_id: int | None = None,
    max_seq_len: int | None = None,
    device: torch.device | str = "cpu",
) -> list[int]:
    """The ids that ``model`` appends to ``prompt``, one at a time (the prompt itself not included).

    Args:
        model: maps token ids ``[1, S]`` to logits ``[1, S, V]`` (call ``model.eval()`` first).
        prompt: the prompt's token ids (at least one).
        max_new_tokens: tokens to generate at most.
        temperature: 0 = greedy (argmax); > 0 samples from the softmax of ``logits / temperature``.
        top_k: sample among the ``top_k`` most likely tokens only (None = all).
        seed: seeds the sampling generator, so a sampled continuation is reproducible.
        eos_id: stop after generating this id (it is included in the result).
        max_seq_len: the model's context: only the last ``max_seq_len`` tokens are fed to it.
        device: where the ids are placed for the model.
    """
    ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, Tensor) else prompt)]
    if not ids:
        raise ValueError("The prompt encodes to no tokens; give a non-empty prompt.")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = ids[-max_seq_len:] if max_seq_len else ids
        logits = model(torch.tensor([window], dtype=torch.int64, device=device))[0, -1]
        token = next_token(logits, temperature, top_k, generator)
        ids.append(token)
        new.append(token)
        if eos_id is not None and token == eos_id:
            break
    return new
