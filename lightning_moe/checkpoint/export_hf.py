"""Export a training checkpoint as a Hugging Face model directory (``lightning-moe export --format hf``).

:func:`export_hf` reads a checkpoint of any layout as :func:`~lightning_moe.checkpoint.export.export_checkpoint`
does (sharded at any TP/EP/ETP and sharding strategy, or consolidated; completeness and checksums
checked; nothing executed), takes the :class:`~lightning_moe.models.MoETransformer` weights of a
:class:`~lightning_moe.lit.MoELanguageModel` (``model.*`` keys) and writes ``config.json`` and
safetensors files that ``transformers`` loads (:func:`lightning_moe.models.hf.save_pretrained`'s
layout: per-expert tensors, shards with an index past ``max_shard_size``).

The model's configuration is the one ``MoELanguageModel`` records in each checkpoint under
:data:`MODEL_CONFIG_KEY` (with the Hugging Face family, token ids and whole ``config.json`` of an
``init_from`` directory), else its ``model`` hyperparameter. A model fine-tuned from ``init_from``
is written with that directory's ``config.json``, unchanged except where the model changed
(:func:`~lightning_moe.models.hf.source.exported_config`), and with its tokenizer and
``generation_config.json`` files, copied from the directory (a warning names those gone). The family defaults to the recorded one, else the
only family the configuration can be (:func:`~lightning_moe.models.hf.infer_family`); what the
family cannot hold is refused before anything is written. The directory is written under a hidden
sibling name and renamed into place once complete.

One process, one tensor at a time: the Hugging Face names, shapes and dtypes follow from the
checkpoint's entries before any weight is read (:func:`~lightning_moe.checkpoint.reader.open_checkpoint`),
so every shard's header is written first and each of our tensors is read when the writer reaches
its first Hugging Face tensor, written out as its per-expert views, and dropped
(:func:`~lightning_moe.models.hf.io.write_safetensors_lazily`). The process holds about twice the
largest tensor (the tensor and the piece DCP is reading into it), never a shard or the model;
shards ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json`` past
``max_shard_size``, as ``transformers``' ``save_pretrained`` writes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_moe.checkpoint.export import ExportedCheckpoint, write_failure
from lightning_moe.checkpoint.files import partial_path
from lightning_moe.checkpoint.reader import CheckpointSource, Entry, open_checkpoint
from lightning_moe.layers.config import MoEConfig
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.config_export import infer_family
from lightning_moe.models.hf.io import TensorSpec, read_config, write_config, write_safetensors_lazily
from lightning_moe.models.hf.source import copy_source_files, exported_config, source_files_in
from lightning_moe.models.hf.weights import hf_defaults, hf_pieces

__all__ = ["MODEL_CONFIG_KEY", "config_from_dict", "export_hf", "model_record", "recorded_config"]

MODEL_CONFIG_KEY = "moe_transformer"
"""Checkpoint entry of ``MoELanguageModel``: ``{"config": asdict(config), "hf_family", "hf_extra_config"}``."""

_PREFIX = "model."


def config_from_dict(fields: dict[str, Any]) -> MoETransformerConfig:
    """The :class:`MoETransformerConfig` of ``dataclasses.asdict(config)`` (nested ``moe`` included)."""
    fields = dict(fields)
    if isinstance(fields.get("moe"), dict):
        fields["moe"] = MoEConfig(**fields["moe"])
    return MoETransformerConfig(**fields)


def model_record(
    config: MoETransformerConfig, family: str | None, extra: dict[str, Any] | None,
    source_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """What ``MoELanguageModel`` stores under :data:`MODEL_CONFIG_KEY` (plain containers only).

    With ``source_dir`` (the ``init_from`` directory) also its whole ``config.json``
    (``hf_source_config``), its absolute path (``hf_source_dir``) and which of
    :data:`~lightning_moe.models.hf.source.SOURCE_FILES` it holds (``hf_source_files``), so the
    export writes the source's ``config.json`` and copies its tokenizer.
    """
    record = {"config": dataclasses.asdict(config), "hf_family": family, "hf_extra_config": dict(extra or {})}
    if source_dir is not None:
        record.update(hf_source_config=read_config(source_dir), hf_source_dir=str(Path(source_dir).resolve()),
                      hf_source_files=source_files_in(source_dir))
    return record


def _record(extras: dict[str, Any], source: Path) -> tuple[MoETransformerConfig, dict[str, Any]]:
    """``(config, record)``: the recorded configuration and the rest of the record (empty for a bare ``model`` hyperparameter)."""
    record = extras.get(MODEL_CONFIG_KEY)
    if isinstance(record, dict) and isinstance(record.get("config"), dict):
        return config_from_dict(record["config"]), record
    hparams = extras.get("hyper_parameters") or {}
    if isinstance(hparams.get("model"), dict):
        return config_from_dict(hparams["model"]), {}
    raise ValueError(
        f"{source} records no MoETransformer configuration (no {MODEL_CONFIG_KEY!r} entry, no 'model' "
        "hyperparameter): --format hf exports checkpoints of lightning_moe.lit.MoELanguageModel; use "
        "--format torch for the weights of any other LightningModule."
    )


def recorded_config(extras: dict[str, Any], source: str | os.PathLike) -> MoETransformerConfig:
    """The :class:`MoETransformerConfig` a ``MoELanguageModel`` checkpoint records (``extras`` as
    :func:`~lightning_moe.checkpoint.export.read_checkpoint` returns them); ``ValueError``
    naming ``source`` when it records none (another LightningModule's checkpoint)."""
    return _record(extras, Path(source))[0]


def _check_output(output: Path, checkpoint: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise NotADirectoryError(20, f"The output {output} is a file; --format hf writes a directory")
    source, target = checkpoint.resolve(), output.resolve()
    if target == source or source in target.parents or (source.is_dir() and target in source.parents):
        raise ValueError(f"The output {output} overlaps the checkpoint {checkpoint}; write the export elsewhere.")
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise FileExistsError(17, f"The output directory {output} is not empty; pass --overwrite to replace it")


def _replace_directory(partial: Path, output: Path) -> None:
    old = None
    if output.exists():
        old = partial_path(output, "old-" + uuid.uuid4().hex)
        os.replace(output, old)
    os.replace(partial, output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _copy_source_files(record: dict[str, Any], target: Path) -> None:
    """Copy the tokenizer and generation files the ``init_from`` directory held into ``target``; warn,
    naming them, about those that are gone (the directory moved or was deleted since training)."""
    names, directory = record.get("hf_source_files") or [], record.get("hf_source_dir")
    if not names or directory is None:
        return
    missing = copy_source_files(directory, list(names), target)
    if missing:
        warnings.warn(
            f"The export holds no {', '.join(missing)}: the init_from directory {directory} held them when training "
            "started but they are not there now. Copy them into the export from the original model, or "
            "AutoTokenizer.from_pretrained(export) will not find the model's tokenizer.",
            UserWarning, stacklevel=3,
        )


class _HFLayout:
    """The Hugging Face tensors of a checkpoint's model: names, shapes and dtypes up front (from the
    checkpoint's entries), values read one of our tensors at a time when the writer asks for them."""

    def __init__(self, source: CheckpointSource, entries: dict[str, Entry], config: MoETransformerConfig,
                 family: str) -> None:
        self.source, self.entries, self.config, self.family = source, entries, config, family
        self.owner: dict[str, str] = {}  # Hugging Face name -> our key
        self.specs: dict[str, TensorSpec] = {}
        for key, entry in entries.items():
            for name, piece in hf_pieces(key, torch.empty(entry.shape, dtype=entry.dtype, device="meta"), config,
                                         family).items():
                self.owner[name] = key
                self.specs[name] = (piece.shape, piece.dtype)
        self.defaults = hf_defaults(self.specs, config, family)
        self.specs.update({name: (value.shape, value.dtype) for name, value in self.defaults.items()})
        self._cached: tuple[str | None, dict[str, Tensor]] = (None, {})

    def get(self, name: str) -> Tensor:
        """The tensor ``name``: a view of the one of our tensors it comes from, read (and kept until
        another is needed) on first use."""
        if name in self.defaults:
            return self.defaults[name]
        key = self.owner[name]
        if self._cached[0] != key:
            self._cached = (None, {})  # drop the previous tensor before reading the next
            entry = self.entries[key]
            (value,) = self.source.read([entry]).values()
            self._cached = (key, hf_pieces(key, value, self.config, self.family))
        return self._cached[1][name]


def export_hf(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    family: str | None = None,
    overwrite: bool = False,
    verify: bool = True,
    max_shard_size: int | str = "5GB",
) -> ExportedCheckpoint:
    """Write the ``MoELanguageModel`` weights of ``checkpoint`` (any layout) as the Hugging Face directory ``output``.

    Args:
        checkpoint: a sharded checkpoint directory or a consolidated checkpoint file.
        output: the directory to write (created; an existing non-empty one needs ``overwrite``).
        family: a registered family (``model_families()``, e.g. ``qwen3_moe``); default: recorded or inferred.
        overwrite: replace a non-empty ``output`` (only once the export succeeded).
        verify: check every file of a sharded checkpoint against its recorded SHA-256 first.
        max_shard_size: safetensors shard size (bytes or a string such as ``"5GB"``).

    Raises what :func:`~lightning_moe.checkpoint.export.export_checkpoint` raises, and
    ``ValueError`` for a checkpoint without a recorded configuration or a model the family cannot hold.
    """
    source, target = Path(checkpoint), Path(output)
    _check_output(target, source, overwrite)
    opened = open_checkpoint(source, verify=verify)
    config, record = _record(opened.extras, source)
    family = family or record.get("hf_family") or infer_family(config)
    entries = {entry.path[0][len(_PREFIX):]: entry for entry in opened.entries
               if len(entry.path) == 1 and entry.path[0].startswith(_PREFIX) and entry.shape is not None}
    if not entries:
        raise ValueError(f"{source} holds no 'model.*' weights: it is not a MoELanguageModel checkpoint.")
    hf_config = exported_config(  # refuses before writing
        config, family, entries["embed.weight"].dtype, record.get("hf_extra_config") or {},
        record.get("hf_source_config"),
    )
    layout = _HFLayout(opened, entries, config, family)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(target, uuid.uuid4().hex)
    try:
        num_bytes = write_safetensors_lazily(layout.specs, layout.get, partial, max_shard_size)
        write_config(hf_config, partial)
        _copy_source_files(record, partial)
        _check_output(target, source, overwrite)  # it may have appeared while the checkpoint was read
        _replace_directory(partial, target)
    except BaseException as err:
        with contextlib.suppress(OSError):
            shutil.rmtree(partial)
        failure = write_failure(target, err)
        if failure is err:
            raise
        raise failure from err
    return ExportedCheckpoint(
        source=source, output=target, kind=opened.kind, num_tensors=len(layout.specs), num_bytes=num_bytes,
        layout=opened.layout, verified=opened.verified,
    )
