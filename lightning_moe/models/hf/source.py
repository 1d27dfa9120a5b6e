"""What of the source Hugging Face directory an export keeps: its ``config.json`` and its tokenizer files.

A model fine-tuned from a Hugging Face directory (``MoELanguageModel(init_from=...)``,
``MoETransformer.from_pretrained``) is exported as the same model: :func:`exported_config` gives
the source's ``config.json`` unchanged, key by key, except where the model itself changed. Training
settings that ``config.json`` happens to carry (``max_seq_len`` as ``max_position_embeddings``,
``init_std`` as ``initializer_range``, the load-balancing coefficients as ``router_aux_loss_coef``
or ``aux_loss_alpha``) are not changes of the model: a run with ``model_overrides: {max_seq_len:
128}`` still exports the source's context length. The weights' dtype is written as they are
stored; a ``quantization_config`` is dropped, because the weights are written dequantised (GPT-OSS's MXFP4
experts). :data:`SOURCE_FILES` (tokenizer and generation settings) are copied by :func:`copy_source_files`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.config_export import config_to_hf
from lightning_moe.models.hf.config_map import config_from_hf

__all__ = ["SOURCE_FILES", "copy_source_files", "exported_config", "source_files_in"]

SOURCE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
)
"""Files of a Hugging Face model directory besides the weights and ``config.json`` that an export copies:
the tokenizer (``AutoTokenizer`` reads them) and ``generation_config.json``."""

_MISSING = object()


def source_files_in(path: str | os.PathLike) -> list[str]:
    """The names of :data:`SOURCE_FILES` present in the directory ``path``."""
    return [name for name in SOURCE_FILES if (Path(path) / name).is_file()]


def copy_source_files(source: str | os.PathLike, names: list[str], target: str | os.PathLike) -> list[str]:
    """Copy the files ``names`` from the directory ``source`` into ``target``; return those not found."""
    missing = []
    for name in names:
        file = Path(source) / name
        if file.is_file():
            shutil.copyfile(file, Path(target) / name)
        else:
            missing.append(name)
    return missing


def _with_training_settings_of(config: MoETransformerConfig, source: MoETransformerConfig) -> MoETransformerConfig:
    """``config`` with the source's values of the training settings ``config.json`` records."""
    moe = config.moe
    if moe is not None and source.moe is not None:
        moe = dataclasses.replace(moe, load_balancing=source.moe.load_balancing,
                                  aux_loss_coeff=source.moe.aux_loss_coeff, init_std=source.moe.init_std)
    return dataclasses.replace(config, max_seq_len=source.max_seq_len, init_std=source.init_std, moe=moe)


def exported_config(
    config: MoETransformerConfig, family: str, dtype: torch.dtype, extra: dict[str, Any] | None = None,
    source: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``config.json`` to write for ``config`` as a ``family`` model whose weights are ``dtype``.

    Without ``source`` (the ``config.json`` the model was loaded from), or from another family:
    :func:`~lightning_moe.models.hf.config_export.config_to_hf`. With it: ``source`` itself, every
    key and value kept, except the keys :func:`config_to_hf` writes differently for ``config``
    than for the source's own configuration (a real change of the model; training settings do not
    count, see the module docstring), and the ``dtype`` (``torch_dtype``) key when the weights are
    stored in another dtype; ``quantization_config`` is dropped (the weights are written dequantised). Whatever the family cannot hold is refused as by :func:`config_to_hf`.
    """
    written = config_to_hf(config, family, dtype, extra)  # refuses what the family cannot hold
    if source is None or source.get("model_type") != family:
        return written
    try:
        loaded, _ = config_from_hf(source)
        before = config_to_hf(loaded, family, dtype, extra)
    except ValueError:
        return written  # the source cannot be compared field by field: write the model's own description
    after = config_to_hf(_with_training_settings_of(config, loaded), family, dtype, extra)
    merged = dict(source)
    # Weights are written as the model holds them: a quantised source (MXFP4) is saved dequantised.
    merged.pop("quantization_config", None)
    for key in before.keys() | after.keys():
        if before.get(key, _MISSING) != after.get(key, _MISSING):
            if key in after:
                merged[key] = after[key]
            else:
                merged.pop(key, None)
    stored = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in merged and merged[key] != stored:
            merged[key] = stored
    return merged
