"""Hugging Face model directories in and out of :class:`~lightning_moe.models.MoETransformer`.

:func:`load_pretrained` (``MoETransformer.from_pretrained``) reads ``config.json`` and the
safetensors weights of a Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3 (Kimi K2), GLM-4.5 or GPT-OSS directory; :func:`save_pretrained`
(``model.save_pretrained``) writes the directory ``transformers`` loads for that family. No
``transformers`` import: the files are read directly (safetensors, the ``hf`` extra).

* :mod:`.families`: one file per family (its config mapping, tensor names and quirks), each
  registered in :mod:`.registry` (:func:`~.registry.family`, :data:`~.registry.FAMILIES`);
* :mod:`.config_map` / :mod:`.config_export`: ``config.json`` <-> :class:`MoETransformerConfig`,
  the machinery every family shares (:mod:`.fields`, :mod:`.softmax_family`);
* :mod:`.weights`: tensor names, per-expert <-> stacked experts;
* :mod:`.io`: safetensors files, shards and their index.
* :mod:`.swap`: ``transformers`` models in memory, their MoE blocks replaced by `MoELayer` s and back.

Both functions work on one process holding the whole model; multi-token prediction (DeepSeek-V3's
MTP layers) is not implemented: its tensors are skipped on load with a warning.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch import nn

import lightning_moe.models.hf.families  # noqa: F401  (registers the built-in families before the registry is read)
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.config_export import PASSTHROUGH_KEYS, config_to_hf, infer_family
from lightning_moe.models.hf.config_map import FAMILIES, config_from_hf
from lightning_moe.models.hf.io import SafetensorsReader, read_config, write_config, write_safetensors
from lightning_moe.models.hf.mxfp4 import dequantized_dtype, mxfp4_pairs
from lightning_moe.models.hf.size_check import check_declared_sizes
from lightning_moe.models.hf.source import exported_config
from lightning_moe.models.hf.weights import hf_state_dict, hf_tensors

__all__ = [
    "FAMILIES", "PASSTHROUGH_KEYS", "config_from_hf", "config_to_hf", "infer_family", "load_pretrained", "pretrained_config",
    "save_pretrained",
]


def _apply_overrides(config: MoETransformerConfig, overrides: dict[str, Any]) -> MoETransformerConfig:
    moe = overrides.pop("moe", None)
    if isinstance(moe, dict):
        if config.moe is None:
            raise ValueError("moe overrides were given but the checkpoint's model is dense (moe=None).")
        moe = dataclasses.replace(config.moe, **moe)
    if moe is not None:
        overrides["moe"] = moe
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(MoETransformerConfig)})
    if unknown:
        raise TypeError(f"Unknown MoETransformerConfig field(s) {unknown} in from_pretrained overrides.")
    return dataclasses.replace(config, **overrides) if overrides else config


def pretrained_config(path: str | os.PathLike, **overrides) -> tuple[MoETransformerConfig, str]:
    """``(config, family)`` of the Hugging Face directory ``path``: its ``config.json`` mapped to a
    :class:`MoETransformerConfig`, with ``overrides`` replacing fields (``moe`` may be a dict of
    :class:`~lightning_moe.MoEConfig` fields), as :func:`load_pretrained` builds it. No weight is read: the declared sizes are checked against
    the safetensors headers first (:func:`~lightning_moe.models.hf.size_check.check_declared_sizes`)."""
    raw = read_config(path)
    check_declared_sizes(path, raw)  # before any size is used: the folder may come from anyone
    config, family = config_from_hf(raw)
    return _apply_overrides(config, dict(overrides)), family


def _materialise_buffers(model: nn.Module) -> None:
    """Zero CPU tensors for the buffers of a meta-built model (the router's counters)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device="cpu")


def load_pretrained(
    path: str | os.PathLike, dtype: torch.dtype | None = None, *, model_class: type[nn.Module], **overrides
) -> nn.Module:
    """The ``model_class`` model of the Hugging Face directory ``path`` with its weights, on the CPU.

    ``model_class`` is built from the mapped :class:`MoETransformerConfig`
    (``MoETransformer.from_pretrained`` passes its own class, so this package never imports the model).

    The model is built on the meta device and every parameter is then the tensor read from the
    files (no random initialisation, no second copy), in the file's dtype unless ``dtype`` casts
    all of them (the router's expert bias stays fp32). MXFP4 tensors (GPT-OSS's experts) are
    dequantised to ``config.json``'s dtype, as ``transformers`` does
    (:func:`~lightning_moe.models.hf.mxfp4.dequantized_dtype`), or to ``dtype``. ``overrides`` replace config fields (see
    ``MoETransformer.from_pretrained``); the family's name and the token ids of ``config.json``
    are kept on the model (``hf_family``, ``hf_extra_config``, and the whole ``config.json`` as
    ``hf_source_config``) for :func:`save_pretrained`.
    """
    raw = read_config(path)
    config, family = pretrained_config(path, **overrides)
    with torch.device("meta"):
        model = model_class(config)
    _materialise_buffers(model)
    expected = list(model.state_dict().keys())
    with SafetensorsReader(path) as reader:
        # MXFP4 experts (GPT-OSS) in the dtype their biases are stored in, as transformers loads them;
        # dequantised straight to dtype= when given (no wider copy first). Other directories' dtype is not read.
        mxfp4_dtype = dtype or (dequantized_dtype(raw) if mxfp4_pairs(reader.keys()) else torch.float32)
        state = hf_state_dict(reader.get, reader.keys(), config, family, expected, mxfp4_dtype)
        model.load_state_dict(state, strict=True, assign=True)
    model._tie_weights()
    if dtype is not None:
        model.to(dtype)
    model.hf_family = family
    model.hf_extra_config = {key: raw[key] for key in PASSTHROUGH_KEYS if key in raw}
    model.hf_source_config = raw  # save_pretrained writes it back, unchanged where the model did not change
    return model


def save_pretrained(
    model: nn.Module, path: str | os.PathLike, family: str | None = None, max_shard_size: int | str = "5GB"
) -> None:
    """Write ``model`` as a Hugging Face ``family`` directory (``config.json`` + safetensors) at ``path``.

    ``family`` defaults to the one the model was loaded from, else :func:`infer_family`. The
    config is checked before anything is written; a model loaded by :func:`load_pretrained` writes
    its source's ``config.json``, unchanged where the model did not change
    (:func:`~lightning_moe.models.hf.source.exported_config`). Needs the whole model on this process: a
    tensor- or expert-parallel model is refused (gather it into a single-device model first).
    """
    config = model.config
    family = family or getattr(model, "hf_family", None) or infer_family(config)
    state = model.state_dict()
    sharded = [k for k, v in state.items() if hasattr(v, "placements")]
    sharded += [f"layers.{i}.ffn.experts" for i in config.moe_layers
                if model.layers[i].ffn.experts.num_experts != config.moe.num_experts]
    if sharded:
        raise ValueError(
            f"save_pretrained needs the whole model on this process, but {sharded[0]} (and {len(sharded) - 1} "
            "more) is sharded across ranks; save from a single-device copy of the model."
        )
    hf_config = exported_config(config, family, model.embed.weight.dtype, getattr(model, "hf_extra_config", None),
                                getattr(model, "hf_source_config", None))
    tensors = hf_tensors(state, config, family)
    os.makedirs(path, exist_ok=True)
    write_safetensors(tensors, path, max_shard_size)
    write_config(hf_config, path)
