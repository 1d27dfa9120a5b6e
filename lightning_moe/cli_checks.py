"""Configuration mistakes the ``lightning-moe`` CLI finds before any process starts.

Each would otherwise fail only after every rank launched, joined its process groups and read its
data, once per rank: a batch that does not split into the pipeline's micro-batches, a sequence
length that context or sequence parallelism cannot cut, a ``val_fraction`` the corpus cannot
honour, an ``init_from`` directory of an unsupported family, ``model_overrides`` keys that are no
fields. The checks are arithmetic on the parsed configuration (and a listing of the corpus'
files): nothing is tokenized, no weight is read. Every problem found is listed in one
:class:`~lightning_moe.parallel.config_error.ConfigError`.

* :func:`init_from_problems` runs on the parsed configuration, before the model is built
  (building ``MoELanguageModel(init_from=...)`` reads ``config.json``);
* :func:`config_problems` runs on the built model, data module and strategy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from lightning_moe.data.token_check import vocab_problem
from lightning_moe.layers.config import MoEConfig
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.parallel.config_error import ConfigError, raise_problems

__all__ = [
    "check_config_before_launch", "check_init_from_before_launch", "config_problems", "init_from_problems",
    "sequence_multiple",
]


def sequence_multiple(cp: int, tp: int) -> int:
    """The multiple every sequence length must be under CP and TP: context parallelism cuts each
    sequence into ``2 * cp`` equal chunks (two per CP rank), then sequence parallelism splits each
    rank's ``seq / cp`` tokens into ``tp`` equal slices; so ``cp * lcm(2, tp)`` (1 without CP and TP)."""
    if cp == 1:
        return tp
    return cp * math.lcm(2, tp)


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def init_from_problems(init_from: str, overrides: dict[str, Any] | None) -> list[str]:
    """Why ``MoELanguageModel(init_from=init_from, model_overrides=overrides)`` cannot be built: a
    directory without ``config.json``, an unsupported ``model_type`` or mapping, keys of
    ``overrides`` (or of its ``moe`` mapping) that are not fields. ``[]`` if it can."""
    from lightning_moe.models.hf import pretrained_config  # the config mapping; no weight is read

    overrides = dict(overrides or {})
    problems = []
    unknown = sorted(set(overrides) - set(_field_names(MoETransformerConfig)))
    if unknown:
        problems.append(
            f"model.model_overrides has key(s) {unknown} that are not MoETransformerConfig fields; the fields are "
            f"{_field_names(MoETransformerConfig)}."
        )
    moe = overrides.get("moe")
    if isinstance(moe, dict):
        unknown_moe = sorted(set(moe) - set(_field_names(MoEConfig)))
        if unknown_moe:
            problems.append(
                f"model.model_overrides.moe has key(s) {unknown_moe} that are not MoEConfig fields; the fields are "
                f"{_field_names(MoEConfig)}."
            )
    if problems:
        return problems
    try:
        pretrained_config(init_from, **overrides)
    except (OSError, ValueError, TypeError) as err:
        text = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        problems.append(f"model.init_from={init_from!r}: {text}")
    return problems


def _data_problems(datamodule: Any) -> list[str]:
    from lightning_moe.data.split import split_corpus
    from lightning_moe.data.token_files import is_token_directory

    hp = datamodule.hparams
    if is_token_directory(hp.source):
        return []  # its split was fixed when it was written (build_datasets checks val_fraction against it)
    try:
        split_corpus(hp.source, hp.val_fraction, hp.pattern)
    except (OSError, ValueError) as err:
        text = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        return [f"data.source={hp.source!r}, data.val_fraction={hp.val_fraction}: {text}"]
    return []


def config_problems(model: Any, datamodule: Any, strategy: Any, subcommand: str | None = None) -> list[str]:
    """Every mistake visible in the built ``model``, ``datamodule`` and ``strategy`` (a ``MoEStrategy``;
    anything else is not checked) for ``subcommand`` (``fit``, ``test`` ...): ``test`` and
    ``predict`` under PP; the data module's ``batch_size`` against ``num_microbatches`` under PP; with :class:`~lightning_moe.lit.TextDataModule`, its ``seq_len`` against CP and TP
    (:func:`sequence_multiple`) and the model's ``max_seq_len``, its tokenizer's ``vocab_size``
    against the model's, and its ``val_fraction`` against the
    corpus' documents (the data module's own split, :func:`~lightning_moe.data.split_corpus`)."""
    from lightning_moe.lit import TextDataModule
    from lightning_moe.strategies import MoEStrategy
    from lightning_moe.strategies.pipeline_step import pipeline_refusal

    if not isinstance(strategy, MoEStrategy):
        return []
    problems = []
    sizes = strategy.sizes
    hparams = getattr(datamodule, "hparams", None) or {}
    batch = hparams.get("batch_size")
    pipeline = getattr(strategy, "_pipeline", None)
    if pipeline is not None and subcommand in ("test", "predict"):
        problems.append(f"pipeline_parallel_size={sizes['pp']} does not support {pipeline_refusal(subcommand)}.")
    if pipeline is not None and pipeline.schedule == "1F1B" and pipeline.num_microbatches < sizes["pp"]:
        # torch's Schedule1F1B refuses it at the first training step, once every rank has started.
        problems.append(
            f"pipeline_schedule='1F1B' needs at least as many micro-batches as stages: num_microbatches="
            f"{pipeline.num_microbatches} < pipeline_parallel_size={sizes['pp']}; pass num_microbatches={sizes['pp']} "
            "or more (dividing data.batch_size), or pipeline_schedule='GPipe'."
        )
    if pipeline is not None and isinstance(batch, int) and batch % pipeline.num_microbatches:
        problems.append(
            f"data.batch_size={batch} does not split into num_microbatches={pipeline.num_microbatches} equal "
            f"micro-batches (pipeline_parallel_size={sizes['pp']}); use a batch size that is a multiple of "
            f"num_microbatches, or a num_microbatches that divides {batch}."
        )
    if isinstance(datamodule, TextDataModule):
        seq = datamodule.hparams.seq_len
        multiple = sequence_multiple(sizes["cp"], sizes["tp"])
        if seq % multiple:
            problems.append(
                f"data.seq_len={seq} is not a multiple of {multiple}: with context_parallel_size={sizes['cp']} each "
                f"sequence is cut into 2 x CP = {2 * sizes['cp']} equal chunks, and with tensor_parallel_size="
                f"{sizes['tp']} each rank's tokens into TP equal slices; use seq_len = a multiple of {multiple}, "
                f"e.g. {max(multiple, seq // multiple * multiple)}."
            )
        config = getattr(model, "config", None)
        vocab = getattr(config, "vocab_size", None)
        if isinstance(vocab, int) and datamodule.vocab_size > vocab:
            problems.append(vocab_problem(datamodule.vocab_size, vocab))
        max_seq_len = getattr(config, "max_seq_len", None)
        if isinstance(max_seq_len, int) and seq > max_seq_len:
            problems.append(
                f"data.seq_len={seq} exceeds the model's max_seq_len={max_seq_len}; shorten data.seq_len or raise "
                "max_seq_len (model.model.max_seq_len, or model.model_overrides with init_from)."
            )
        problems.extend(_data_problems(datamodule))
    return problems


def check_config_before_launch(model: Any, datamodule: Any, strategy: Any, subcommand: str | None = None) -> None:
    """Raise :class:`ConfigError` listing every problem of :func:`config_problems`, if any."""
    _raise(config_problems(model, datamodule, strategy, subcommand))


def check_init_from_before_launch(init_from: str, overrides: dict[str, Any] | None) -> None:
    """Raise :class:`ConfigError` listing every problem of :func:`init_from_problems`, if any."""
    _raise(init_from_problems(init_from, overrides))


def _raise(problems: list[str]) -> None:
    raise_problems(ConfigError, "The configuration cannot run", problems)
