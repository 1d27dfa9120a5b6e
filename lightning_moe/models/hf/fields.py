"""A Hugging Face ``config.json`` read with its family's defaults: what every family's mapping reads through."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_moe.models.hf.registry import Family

__all__ = ["COMMON_DEFAULTS", "Fields", "aux_loss"]

COMMON_DEFAULTS: Mapping[str, Any] = {
    "hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": False, "attention_bias": False,
    "attention_dropout": 0.0, "rope_scaling": None, "rope_parameters": None, "partial_rotary_factor": 1.0,
}
"""transformers 5.24's defaults of the optional keys every family reads (a published config.json may omit them)."""


class Fields:
    """``config.json`` read with the family's defaults; a missing required key is a clear error.

    Attributes:
        raw: the ``config.json`` dict as read.
        spec: the :class:`~lightning_moe.models.hf.registry.Family` it is read as.
        family: the family's name (errors name it).
    """

    def __init__(self, raw: Mapping[str, Any], spec: Family) -> None:
        self.raw, self.spec, self.family = raw, spec, spec.name
        self.defaults = {**COMMON_DEFAULTS, **spec.defaults}

    def __getitem__(self, key: str) -> Any:
        if key in self.raw:
            return self.raw[key]
        if key in self.defaults:
            return self.defaults[key]
        raise ValueError(f"config.json of this {self.family} model has no {key!r}, which the mapping needs.")

    def first(self, keys: tuple[str, ...]) -> Any:
        """The value of the first of ``keys`` present and not null, or an error naming them all."""
        for key in keys:
            if self.raw.get(key) is not None:
                return self.raw[key]
        raise ValueError(f"config.json of this {self.family} model has none of {list(keys)}.")

    def expert_count(self) -> int:
        """The number of routed experts (the first of the family's expert-count keys present)."""
        return int(self.first(self.spec.expert_count_keys))


def aux_loss(coeff: float) -> dict[str, Any]:
    """``MoEConfig`` keyword arguments of a ``router_aux_loss_coef`` (none when it is 0)."""
    return {"load_balancing": ["aux_loss"], "aux_loss_coeff": float(coeff)} if coeff else {}
