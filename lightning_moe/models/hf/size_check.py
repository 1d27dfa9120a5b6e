"""The sizes a Hugging Face ``config.json`` declares, checked before anything is built from them.

Model folders come from others: a ``config.json`` declaring a million layers or a vocabulary of
10^12 ids would otherwise be allocated (or run for minutes) before any weight is read. Every size
field must be an integer within a sane range (:data:`SIZE_LIMITS`), and the sizes the weights
show in the safetensors headers (only the JSON at the start of each file is read) must agree:
the embedding's ``[vocab_size, hidden_size]``, the number of decoder layers, of experts, and the
experts' width. Each refusal names the field, its value and what the weights say.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_moe.models.hf.io import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME, weight_file
from lightning_moe.models.hf.registry import FAMILIES

__all__ = ["SIZE_LIMITS", "check_declared_sizes", "safetensors_shapes"]

SIZE_LIMITS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 4096), "hidden_size": (1, 2**17), "intermediate_size": (1, 2**20),
    "moe_intermediate_size": (1, 2**20), "num_attention_heads": (1, 2**14), "num_key_value_heads": (1, 2**14),
    "head_dim": (1, 2**14), "vocab_size": (1, 2**24), "max_position_embeddings": (1, 2**27),
    "num_experts": (1, 2**16), "num_local_experts": (1, 2**16), "n_routed_experts": (1, 2**16),
    "num_experts_per_tok": (1, 2**16), "n_shared_experts": (0, 2**10), "first_k_dense_replace": (0, 4096),
    "n_group": (1, 2**16), "topk_group": (1, 2**16), "decoder_sparse_step": (1, 4096),
    "kv_lora_rank": (1, 2**17), "q_lora_rank": (1, 2**17), "qk_nope_head_dim": (1, 2**14),
    "qk_rope_head_dim": (1, 2**14), "v_head_dim": (1, 2**14),
}
"""``config.json`` size field -> the inclusive range accepted (a field left out or ``null`` is not checked)."""
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _expert_count_keys(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys that may hold the expert count: the family's own, else every registered family's."""
    name = raw.get("model_type")
    spec = FAMILIES.get(name) if isinstance(name, str) else None  # a crafted file may hold any JSON value
    if spec is not None:
        return spec.expert_count_keys
    return tuple(dict.fromkeys(key for spec in FAMILIES.values() for key in spec.expert_count_keys))


def _expert_pattern() -> re.Pattern[str]:
    """An expert's gate projection on disk, in any registered family's naming (its index is group 1)."""
    gates = "|".join(sorted({re.escape(spec.expert_names[0]) for spec in FAMILIES.values()}))
    return re.compile(rf"\.experts\.(\d+)\.({gates})\.weight$")


def _header(file: Path) -> dict[str, Any]:
    """The tensor entries of the safetensors ``file``'s header (its first bytes only)."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if length < 2 or length > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{file} is not a safetensors file: its header length {length} does not fit its {size} bytes.")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{file} is not a safetensors file: its header is not JSON ({err}).") from err
    if not isinstance(header, dict):
        raise ValueError(f"{file} is not a safetensors file: its header is not a mapping.")
    return {name: entry for name, entry in header.items() if name != "__metadata__"}


def safetensors_shapes(folder: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` of every weight of the model folder, from the safetensors headers
    alone (the files the index lists, checked as :func:`~lightning_moe.models.hf.io.weight_file`)."""
    folder = Path(folder)
    index, single = folder / INDEX_NAME, folder / WEIGHTS_NAME
    if index.is_file():
        try:
            names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index} is not a safetensors index (no weight_map mapping): {err}.") from err
    elif single.is_file():
        names = {WEIGHTS_NAME}
    else:
        return {}  # the weights reader says what is missing
    shapes: dict[str, tuple[int, ...]] = {}
    for name in sorted(names, key=str):
        for key, entry in _header(weight_file(folder, name, "")).items():
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape):
                shapes[key] = tuple(shape)
    return shapes


def _refuse(file: Path, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{file} declares {field}={value!r}, but {why}; refusing to build a model from it.")


def _check_ranges(file: Path, raw: Mapping[str, Any]) -> None:
    for field, (low, high) in SIZE_LIMITS.items():
        value = raw.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise _refuse(file, field, value, "a size must be an integer")
        if not low <= value <= high:
            raise _refuse(file, field, value, f"a sane value lies in [{low}, {high}]")


def check_declared_sizes(folder: str | os.PathLike, raw: Mapping[str, Any]) -> None:
    """Refuse a ``config.json`` (``raw``, read from ``folder``) whose sizes are absurd or disagree
    with the folder's safetensors headers, naming the field, its value and what the weights hold.

    Weights absent from the headers (a tied head, fused experts) are not compared.
    """
    folder = Path(folder)
    file = folder / CONFIG_NAME
    _check_ranges(file, raw)
    shapes = safetensors_shapes(folder)
    if not shapes:
        return
    embed = shapes.get("model.embed_tokens.weight")
    if embed is not None and len(embed) == 2:
        for field, size in (("vocab_size", embed[0]), ("hidden_size", embed[1])):
            if raw.get(field) is not None and raw[field] != size:
                raise _refuse(file, field, raw[field], f"the weights' model.embed_tokens.weight is {list(embed)}")
    layers = {int(m.group(1)) for key in shapes if (m := _LAYER.match(key))}
    declared = raw.get("num_hidden_layers")
    if layers and declared is not None and declared > max(layers) + 1:
        raise _refuse(file, "num_hidden_layers", declared, f"the weights hold {max(layers) + 1} layers (model.layers.0-{max(layers)})")
    expert = _expert_pattern()
    experts = {int(m.group(1)) for key in shapes if (m := expert.search(key))}
    count_key = next((key for key in _expert_count_keys(raw) if raw.get(key) is not None), None)
    if experts and count_key is not None and raw[count_key] > max(experts) + 1:
        raise _refuse(file, count_key, raw[count_key], f"the weights hold {max(experts) + 1} experts per layer")
    widths = {shape[0] for key, shape in shapes.items() if expert.search(key) and shape}
    width_key = "moe_intermediate_size" if raw.get("moe_intermediate_size") is not None else "intermediate_size"
    if len(widths) == 1 and raw.get(width_key) is not None and raw[width_key] not in widths:
        raise _refuse(file, width_key, raw[width_key], f"the weights' experts are {widths.pop()} wide")
