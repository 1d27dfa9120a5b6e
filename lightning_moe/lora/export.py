"""Export a LoRA checkpoint: merged into its base (``export --merge``), or as a PEFT adapter (``export --adapter``).

A LoRA run's checkpoint holds the adapters only (:mod:`lightning_moe.lora.checkpoint`); its base is
the ``init_from`` directory the run recorded. :func:`export_merged` reads the adapters of the
checkpoint (any layout, checked as every export is), loads the base from that directory (or
``base``, e.g. where it was moved to), checks the base against the fingerprint the checkpoint
recorded, folds the adapters in (:func:`~lightning_moe.lora.merge_lora`) and writes the plain
model: a ``torch.save`` file with the keys of a plain ``MoELanguageModel``'s state dict
(``model.*``), or a Hugging Face directory (``fmt="hf"``) that ``transformers`` loads.

Unlike the plain exports, which stream a tensor at a time, this one holds the whole base model in
this process's memory (on the CPU).

:func:`export_adapter` writes the adapters alone in PEFT's directory format
(:mod:`lightning_moe.lora.peft_format`), for the Hugging Face model the run started from; it
reads only the checkpoint (no base weights).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_moe.checkpoint.export import ExportedCheckpoint, read_checkpoint, write_failure
from lightning_moe.checkpoint.files import partial_path
from lightning_moe.lora.apply import apply_lora, is_adapter_key, merge_lora
from lightning_moe.lora.checkpoint import LORA_RECORD_KEY, base_fingerprint, base_mismatches
from lightning_moe.lora.config import LoRAConfig
from lightning_moe.lora.peft_format import PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME, peft_adapter

__all__ = ["MERGE_FORMATS", "export_adapter", "export_merged"]

MERGE_FORMATS = ("torch", "hf")
"""What :func:`export_merged` writes: one ``torch.save`` file, or a Hugging Face directory."""
_PREFIX = "model."


def _check_output(output: Path, checkpoint: Path, overwrite: bool) -> None:
    source, target = checkpoint.resolve(), output.resolve()
    if target == source or source in target.parents or (source.is_dir() and target in source.parents):
        raise ValueError(f"The output {output} overlaps the checkpoint {checkpoint}; write the export elsewhere.")
    if output.exists() and not overwrite and (output.is_file() or any(output.iterdir())):
        raise FileExistsError(17, f"The output {output} already exists; pass --overwrite (overwrite=True) to replace it")


def _base_path(record: dict, checkpoint: Path, base: str | os.PathLike | None) -> Path:
    path = base if base is not None else record.get("init_from")
    if path is None:
        raise ValueError(
            f"{checkpoint} is a LoRA checkpoint whose base was the seeded initialisation of its model config (no "
            "init_from), which an export cannot rebuild: train from an init_from directory, or pass the base "
            "directory (--base DIR)."
        )
    if not Path(path).is_dir():
        raise FileNotFoundError(2, f"The base {path} of the LoRA checkpoint {checkpoint} is not a directory; pass "
                                   "where it is now (--base DIR)")
    return Path(path)


def _write_atomically(target: Path, source: Path, overwrite: bool, write: Callable[[Path], None]) -> None:
    """``write(partial)`` next to ``target``, then swap it in; on any failure nothing is left behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(target, uuid.uuid4().hex)
    try:
        write(partial)
        _check_output(target, source, overwrite)  # it may have appeared while the checkpoint was read
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        os.replace(partial, target)
    except BaseException as err:
        with contextlib.suppress(OSError):
            shutil.rmtree(partial) if partial.is_dir() else partial.unlink()
        failure = write_failure(target, err)
        if failure is err:
            raise
        raise failure from err


def _exported(source: Path, target: Path, kind, layout, verified: bool, tensors: dict) -> ExportedCheckpoint:
    return ExportedCheckpoint(
        source=source, output=target, kind=kind, num_tensors=len(tensors),
        num_bytes=sum(v.numel() * v.element_size() for v in tensors.values()), layout=layout, verified=verified,
    )


def _lora_record(extras: dict, source: Path) -> dict:
    record = extras.get(LORA_RECORD_KEY)
    if not isinstance(record, dict):
        raise ValueError(f"{source} is not a LoRA checkpoint (no {LORA_RECORD_KEY!r} record): export it without "
                         "--merge or --adapter.")
    return record


def export_adapter(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    family: str | None = None,
    base: str | os.PathLike | None = None,
    overwrite: bool = False,
    verify: bool = True,
) -> ExportedCheckpoint:
    """Write the adapters of the LoRA ``checkpoint`` as a PEFT adapter directory ``output``.

    ``output`` gets ``adapter_config.json`` and ``adapter_model.safetensors``, which
    ``peft.PeftModel.from_pretrained(transformers_model, output)`` applies to the Hugging Face model
    the run started from (the same logits as the trained model); the targets PEFT cannot hold are
    refused by name (:mod:`lightning_moe.lora.peft_format`).

    Args:
        checkpoint: a LoRA run's checkpoint (a sharded directory of any layout, or one file).
        output: the directory to write, atomically.
        family: the Hugging Face family (default: the one the run recorded, else inferred).
        base: ``base_model_name_or_path`` to record (default: the run's ``init_from``).
        overwrite: replace an existing ``output``.
        verify: check the checkpoint's files against their SHA-256 first.

    Raises:
        ValueError: not a LoRA checkpoint, or adapters PEFT cannot load.
        FileNotFoundError, FileExistsError, OSError: as the other exports.
    """
    from safetensors.torch import save_file  # the hf extra

    from lightning_moe.checkpoint.export_hf import MODEL_CONFIG_KEY, recorded_config
    from lightning_moe.models.hf import infer_family

    source, target = Path(checkpoint), Path(output)
    _check_output(target, source, overwrite)
    state, kind, layout, verified, extras = read_checkpoint(source, verify)
    record = _lora_record(extras, source)
    config = recorded_config(extras, source)
    model_record = extras.get(MODEL_CONFIG_KEY) if isinstance(extras.get(MODEL_CONFIG_KEY), dict) else {}
    family = family or model_record.get("hf_family") or infer_family(config)
    adapters = {key[len(_PREFIX):]: value for key, value in state.items()
                if key.startswith(_PREFIX) and is_adapter_key(key)}
    if not adapters:
        raise ValueError(f"{source} records LoRA but holds no adapter tensors (its LoRA targets matched no module, or "
                         "the adapters were filtered out when it was written); export the run's own checkpoint.")
    base_path = base if base is not None else record.get("init_from")
    adapter_config, tensors = peft_adapter(adapters, config, LoRAConfig(**record["config"]), family,
                                           base=None if base_path is None else str(base_path))

    def write(partial: Path) -> None:
        partial.mkdir()
        (partial / PEFT_CONFIG_NAME).write_text(json.dumps(adapter_config, indent=2) + "\n", encoding="utf-8")
        save_file(tensors, str(partial / PEFT_WEIGHTS_NAME), metadata={"format": "pt"})

    _write_atomically(target, source, overwrite, write)
    return _exported(source, target, kind, layout, verified, tensors)


def export_merged(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    fmt: str = "torch",
    base: str | os.PathLike | None = None,
    family: str | None = None,
    overwrite: bool = False,
    verify: bool = True,
    max_shard_size: int | str = "5GB",
) -> ExportedCheckpoint:
    """Write the model of the LoRA ``checkpoint`` with its adapters folded in (module docstring).

    Args:
        checkpoint: a LoRA run's checkpoint (a sharded directory of any layout, or one file).
        output: the file (``fmt="torch"``) or directory (``fmt="hf"``) to write, atomically.
        fmt: ``"torch"`` or ``"hf"``.
        base: the base model's Hugging Face directory (default: the ``init_from`` the run recorded).
        family: ``fmt="hf"``: the Hugging Face family (default: the base directory's).
        overwrite: replace an existing ``output``.
        verify: check the checkpoint's files against their SHA-256 first.
        max_shard_size: ``fmt="hf"``: the largest safetensors file.

    Raises:
        ValueError: not a LoRA checkpoint, no base to read, or the base is not the one the adapters
            were trained on (the differing tensors named); an unknown ``fmt``.
        FileNotFoundError, FileExistsError, OSError: as the other exports.
    """
    if fmt not in MERGE_FORMATS:
        raise ValueError(f"export_merged: fmt must be one of {list(MERGE_FORMATS)}, got {fmt!r}.")
    source, target = Path(checkpoint), Path(output)
    _check_output(target, source, overwrite)
    state, kind, layout, verified, extras = read_checkpoint(source, verify)
    record = _lora_record(extras, source)
    from lightning_moe.models import MoETransformer
    from lightning_moe.models.hf import save_pretrained  # safetensors: the hf extra

    base_dir = _base_path(record, source, base)
    model = MoETransformer.from_pretrained(base_dir)
    apply_lora(model, LoRAConfig(**record["config"]))
    problems = base_mismatches(record["base_fingerprint"], base_fingerprint(model))
    if problems:
        raise ValueError(
            f"{base_dir} is not the base the adapters of {source} were trained on: {len(problems)} tensors differ, "
            f"e.g. {problems[:3]}."
        )
    adapters = {key[len(_PREFIX):]: value for key, value in state.items()
                if key.startswith(_PREFIX) and is_adapter_key(key)}
    result = model.load_state_dict(adapters, strict=False)
    missing = [key for key in result.missing_keys if is_adapter_key(key)]
    if missing or result.unexpected_keys:
        raise ValueError(f"{source}'s adapters do not fit {base_dir}: missing {missing[:8]}, unexpected "
                         f"{result.unexpected_keys[:8]}.")
    merge_lora(model)
    merged = {_PREFIX + key: value for key, value in model.state_dict().items()}

    def write(partial: Path) -> None:
        if fmt == "torch":
            torch.save(merged, partial)
        else:
            save_pretrained(model, partial, family=family, max_shard_size=max_shard_size)

    _write_atomically(target, source, overwrite, write)
    return _exported(source, target, kind, layout, verified, merged)
