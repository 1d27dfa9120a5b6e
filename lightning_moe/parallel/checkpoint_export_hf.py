"""Export a training checkpoint as a Hugging Face model directory (``lightning-moe export --format hf``).

:func:`export_hf` reads a checkpoint of any layout as :func:`~lightning_moe.parallel.checkpoint_export.export_checkpoint`
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
sibling name and renamed into place once complete. One process; the whole model in memory once.
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

from lightning_moe.layers.config import MoEConfig
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.config_export import infer_family
from lightning_moe.models.hf.io import read_config, write_config, write_safetensors
from lightning_moe.models.hf.source import copy_source_files, exported_config, source_files_in
from lightning_moe.models.hf.weights import hf_tensors
from lightning_moe.parallel.checkpoint_export import ExportedCheckpoint, read_checkpoint
from lightning_moe.parallel.checkpoint_files import partial_path

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
    :func:`~lightning_moe.parallel.checkpoint_export.read_checkpoint` returns them); ``ValueError``
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
        family: ``qwen3_moe``, ``mixtral``, ``olmoe`` or ``deepseek_v3``; default: recorded or inferred.
        overwrite: replace a non-empty ``output`` (only once the export succeeded).
        verify: check every file of a sharded checkpoint against its recorded SHA-256 first.
        max_shard_size: safetensors shard size (bytes or a string such as ``"5GB"``).

    Raises what :func:`~lightning_moe.parallel.checkpoint_export.export_checkpoint` raises, and
    ``ValueError`` for a checkpoint without a recorded configuration or a model the family cannot hold.
    """
    source, target = Path(checkpoint), Path(output)
    _check_output(target, source, overwrite)
    state, kind, layout, verified, extras = read_checkpoint(source, verify=verify)
    config, record = _record(extras, source)
    family = family or record.get("hf_family") or infer_family(config)
    model_state = {key[len(_PREFIX):]: value for key, value in state.items() if key.startswith(_PREFIX)}
    if not model_state:
        raise ValueError(f"{source} holds no 'model.*' weights: it is not a MoELanguageModel checkpoint.")
    hf_config = exported_config(  # refuses before writing
        config, family, model_state["embed.weight"].dtype, record.get("hf_extra_config") or {},
        record.get("hf_source_config"),
    )
    tensors = hf_tensors(model_state, config, family)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(target, uuid.uuid4().hex)
    try:
        write_safetensors(tensors, partial, max_shard_size)
        write_config(hf_config, partial)
        _copy_source_files(record, partial)
        _check_output(target, source, overwrite)  # it may have appeared while the checkpoint was read
        _replace_directory(partial, target)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(partial)
        raise
    return ExportedCheckpoint(
        source=source, output=target, kind=kind, num_tensors=len(tensors),
        num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()), layout=layout, verified=verified,
    )
