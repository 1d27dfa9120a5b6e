"""Tensor names and layouts between Hugging Face checkpoints and :class:`MoETransformer`'s state dict.

Hugging Face's on-disk format (what ``save_pretrained`` writes) keeps one tensor per expert:
``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`` (Mixtral:
``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``); ``transformers`` 5 fuses them in memory into
``experts.gate_up_proj`` ``[E, 2F, H]`` (gate rows then up rows) and ``experts.down_proj``
``[E, H, F]``, which is exactly how our experts store ``fc1_weight`` / ``fc2_weight``; our state
dict presents the gated fc1 as ``[E, 2, F, H]`` (:mod:`lightning_moe.layers.expert_state`), a view
of the same numbers. Reading accepts both Hugging Face forms (and Mixtral's in-memory ``mlp``
prefix) and returns the state-dict layout; writing uses the per-expert keys and takes our fc1 in
either layout (an older ``[E, 2F, H]`` export included). The router is
``{mlp}.gate.weight`` -> ``router.weight``; the rest of the MoE block (DeepSeek's and GLM's
``e_score_correction_bias`` -> ``router.expert_bias``, their ``shared_experts.{gate,up,down}_proj``
-> ``shared_expert.fc1`` (gate rows then up rows) and ``fc2``, Qwen2-MoE's ``shared_expert`` and
``shared_expert_gate``) lies where the family's ``block_weights`` say, under the block's prefix.
Attention biases (``attention_bias``, ``attention_out_bias``) keep their names:
``self_attn.{q,k,v,o}_proj.bias``; attention sinks are ``self_attn.sinks``.
Every tensor keeps its dtype; stacking and splitting copy values bit for bit.

A family whose MoE block is laid out otherwise (GPT-OSS: ``mlp.router``, ``gate_up_proj`` ``[E, H, 2F]``
with gate and up interleaved by column, expert biases) gives its own sources
(``Family.moe_sources``), written back by inverting them (:func:`split_source`). A tensor stored as
MXFP4 (``name_blocks`` + ``name_scales``, :mod:`lightning_moe.models.hf.mxfp4`) is read as ``name``,
dequantised to the dtype the caller gives (the directory's ``config.json`` dtype, as ``transformers``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor

from lightning_moe.layers.activations import is_gated
from lightning_moe.layers.expert_state import fc1_checkpoint_view, fc1_from_checkpoint
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, dequantize_mxfp4
from lightning_moe.models.hf.registry import family as _family

__all__ = [
    "Source", "check_leftovers", "deinterleave", "hf_defaults", "hf_pieces", "hf_sources", "hf_state_dict", "hf_tensors",
    "interleave", "read_source", "shared_mlp_sources", "source_names", "split_source",
]

# Our attention parameter -> Hugging Face's (MHA names are the same; MLA as in DeepseekV3Attention).
_MLA_NAMES = {
    "q_proj": "q_proj", "q_down_proj": "q_a_proj", "q_latent_norm": "q_a_layernorm", "q_up_proj": "q_b_proj",
    "kv_down_proj": "kv_a_proj_with_mqa", "kv_latent_norm": "kv_a_layernorm", "kv_up_proj": "kv_b_proj",
    "o_proj": "o_proj",
}
_MHA_NAMES = {name: name for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
_TOP_LEVEL = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "lm_head.weight": "lm_head.weight"}
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
# Keys older checkpoints carry that no model reads (rotary tables saved as buffers).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")


def _moe_prefix(family: str) -> str:
    return _family(family).moe_prefix


def _expert_names(family: str) -> tuple[str, str, str]:
    """(gate, up, down) projection names of one Hugging Face expert."""
    return _family(family).expert_names


def _hf_name(key: str, config: MoETransformerConfig, family: str) -> str:
    """The Hugging Face name of our state-dict ``key`` (not the stacked expert tensors)."""
    if key in _TOP_LEVEL:
        return _TOP_LEVEL[key]
    match = _LAYER_KEY.fullmatch(key)
    rest = match.group(2) if match else ""
    prefix = f"model.layers.{match.group(1)}." if match else ""
    moe = _moe_prefix(family)
    simple = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn.router.weight": f"{moe}.gate.weight",
        **{f"ffn.{name}.weight": f"mlp.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")},
    }
    if rest in simple:
        return prefix + simple[rest]
    if rest == "attn.sinks":  # GPT-OSS's per-head sink logits
        return f"{prefix}self_attn.sinks"
    names = _MLA_NAMES if config.attention == "mla" else _MHA_NAMES
    attention = re.fullmatch(r"attn\.(\w+)\.(weight|bias)", rest)
    if attention and attention.group(1) in names:
        return f"{prefix}self_attn.{names[attention.group(1)]}.{attention.group(2)}"
    raise ValueError(
        f"{key} has no Hugging Face {family} counterpart: this model cannot be written as {family}."
    )


_STACKED = ("ffn.experts.fc1_weight", "ffn.experts.fc2_weight")


def _special(rest: str) -> str | None:
    """``rest`` when it is a routed experts' tensor (Hugging Face splits them per expert), else None."""
    return rest if rest in _STACKED else None


def _block_source(rest: str, family: str) -> Source | None:
    """Where the MoE block's tensor ``rest`` (``ffn.{key}``) lies relative to the block, when the
    family's ``block_weights`` name it (shared expert, shared-expert gate, expert bias), else None."""
    if not rest.startswith("ffn."):
        return None
    return _family(family).block_weights.get(rest.removeprefix("ffn."))


def _prefixed(source: Source, prefix: str, rename: Callable[[str], str] = str) -> Source:
    """``source`` with every tensor name ``prefix + name``, passed through ``rename``."""
    if isinstance(source, str):
        return rename(prefix + source)
    if source[0] == "cat":
        return ("cat", source[1], [_prefixed(part, prefix, rename) for part in source[2]])
    return ("stack", [_prefixed(part, prefix, rename) for part in source[1]])


Source = str | tuple
"""Where one of our tensors lies in a Hugging Face checkpoint: a tensor name (same shape), or
``("cat", dim, [sources])`` (the sources concatenated along ``dim``), or ``("stack", [sources])``
(one source per index of a new dimension 0: the per-expert tensors), or
``("transpose", d0, d1, source)`` (two dimensions swapped), ``("deinterleave", dim, source)``
(positions 0, 2, 4, ... of ``dim`` then 1, 3, 5, ...: interleaved gate/up columns as ``[gate ; up]``),
``("halves", dim, source)`` (``dim`` of size 2n split into a new ``dim`` of 2 and n after it), or
``("mxfp4", blocks name, scales name)`` (dequantised, :func:`~lightning_moe.models.hf.mxfp4.dequantize_mxfp4`)."""


def shared_mlp_sources(prefix: str) -> dict[str, Source]:
    """Where a shared expert's tensors lie in a block whose shared MLP is ``{prefix}.{gate,up,down}_proj``
    (gate and up stacked into fc1)."""
    return {
        "shared_expert.fc1.weight": ("cat", 0, [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"]),
        "shared_expert.fc2.weight": f"{prefix}.down_proj.weight",
    }


def _parts(source: tuple) -> list[Source]:
    """The sources a composite ``source`` is made of."""
    kind = source[0]
    if kind == "cat":
        return list(source[2])
    if kind == "stack":
        return list(source[1])
    if kind == "transpose":
        return [source[3]]
    if kind in ("deinterleave", "halves"):
        return [source[2]]
    raise ValueError(f"Unknown weight source {source!r}.")


def source_names(source: Source) -> list[str]:
    """Every checkpoint tensor name ``source`` reads."""
    if isinstance(source, str):
        return [source]
    if source[0] == "mxfp4":
        return [source[1], source[2]]
    return [name for part in _parts(source) for name in source_names(part)]


def _packed(source: Source, available: set[str]) -> Source:
    """``source`` with each name the checkpoint holds only as MXFP4 (``name_blocks`` + ``name_scales``)
    read through ``("mxfp4", ...)``."""
    if isinstance(source, str):
        blocks, scales = source + BLOCKS_SUFFIX, source + SCALES_SUFFIX
        if source not in available and blocks in available and scales in available:
            return ("mxfp4", blocks, scales)
        return source
    kind = source[0]
    if kind == "cat":
        return ("cat", source[1], [_packed(part, available) for part in source[2]])
    if kind == "stack":
        return ("stack", [_packed(part, available) for part in source[1]])
    if kind == "transpose":
        return ("transpose", source[1], source[2], _packed(source[3], available))
    if kind in ("deinterleave", "halves"):
        return (kind, source[1], _packed(source[2], available))
    return source


def deinterleave(value: Tensor, dim: int) -> Tensor:
    """Positions 0, 2, 4, ... of ``dim`` followed by 1, 3, 5, ...: interleaved gate/up as ``[gate ; up]``."""
    pairs = value.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


def interleave(value: Tensor, dim: int) -> Tensor:
    """The inverse of :func:`deinterleave`: ``[gate ; up]`` along ``dim`` as gate, up, gate, up, ..."""
    gate, up = value.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def split_source(source: Source, value: Tensor) -> dict[str, Tensor]:
    """The checkpoint tensors that ``source`` reads, from our tensor ``value`` (the inverse of
    :func:`read_source`; an MXFP4 source cannot be written back: name the dequantised tensor)."""
    if isinstance(source, str):
        return {source: value}
    kind = source[0]
    if kind == "cat":
        pieces = value.chunk(len(source[2]), dim=source[1])  # equal parts, as every "cat" source here
        return {k: v for part, piece in zip(source[2], pieces) for k, v in split_source(part, piece).items()}
    if kind == "stack":
        return {k: v for part, piece in zip(source[1], value.unbind(0)) for k, v in split_source(part, piece).items()}
    if kind == "transpose":
        return split_source(source[3], value.transpose(source[1], source[2]))
    if kind == "deinterleave":
        return split_source(source[2], interleave(value, source[1]))
    if kind == "halves":
        return split_source(source[2], value.flatten(source[1], source[1] + 1))
    raise ValueError(f"Cannot write the weight source {source!r}: write the dequantised tensor instead.")


def hf_sources(
    available: Iterable[str], config: MoETransformerConfig, family: str, expected: Iterable[str]
) -> dict[str, Source]:
    """Where each of our state-dict keys ``expected`` lies among the checkpoint's names ``available``.

    The tied head (``lm_head.weight`` with ``tie_embeddings``) is left out: it is the embedding's
    tensor. Experts come from the per-expert tensors, or from ``transformers`` 5's fused
    in-memory ``gate_up_proj`` / ``down_proj`` when the checkpoint holds those.
    """
    available = set(available)

    def name_of(name: str) -> str:
        # transformers 5 names Mixtral's MoE block "mlp" in memory (a state dict saved as is).
        alias = name.replace(".block_sparse_moe.", ".mlp.")
        return alias if name not in available and alias in available else name

    sources: dict[str, Source] = {}
    moe_sources = _family(family).moe_sources
    for key in expected:
        match = _LAYER_KEY.fullmatch(key)
        own = _own_source(moe_sources, match, config, family)
        if own is not None:
            sources[key] = _packed(own, available)
            continue
        block = _block_source(match.group(2), family) if match else None
        if block is not None:
            sources[key] = _prefixed(block, f"model.layers.{match.group(1)}.{_moe_prefix(family)}.", name_of)
            continue
        special = _special(match.group(2)) if match else None
        if special is None:
            if key == "lm_head.weight" and config.tie_embeddings:
                continue  # the embedding's tensor; transformers does not store it twice
            sources[key] = name_of(_hf_name(key, config, family))
            continue
        layer = f"model.layers.{match.group(1)}.{_moe_prefix(family)}"
        fused = next((f"model.layers.{match.group(1)}.{p}.experts" for p in (_moe_prefix(family), "mlp")
                      if f"model.layers.{match.group(1)}.{p}.experts.gate_up_proj" in available), None)
        if fused is not None:
            sources[key] = f"{fused}.{'gate_up_proj' if special.endswith('fc1_weight') else 'down_proj'}"
            continue
        gate, up, down = _expert_names(family)
        experts = range(config.moe.num_experts)
        if special.endswith("fc1_weight"):
            sources[key] = ("stack", [("cat", 0, [name_of(f"{layer}.experts.{e}.{gate}.weight"),
                                                  name_of(f"{layer}.experts.{e}.{up}.weight")]) for e in experts])
        else:
            sources[key] = ("stack", [name_of(f"{layer}.experts.{e}.{down}.weight") for e in experts])
    return sources


def _own_source(moe_sources, match, config: MoETransformerConfig, family: str) -> Source | None:
    """The family's own source of a layer's MoE tensor (``Family.moe_sources``), None if it has none."""
    if moe_sources is None or match is None or not match.group(2).startswith("ffn."):
        return None
    layer = f"model.layers.{match.group(1)}.{_moe_prefix(family)}"
    return moe_sources(layer, config).get(match.group(2).removeprefix("ffn."))


def read_source(source: Source, get: Callable[[str], Tensor], mxfp4_dtype: torch.dtype = torch.float32) -> Tensor:
    """The whole tensor ``source`` describes, read by ``get(name)``; an MXFP4 part dequantised to
    ``mxfp4_dtype`` (stored tensors keep their dtype)."""
    if isinstance(source, str):
        return get(source)
    kind = source[0]
    if kind == "cat":
        return torch.cat([read_source(part, get, mxfp4_dtype) for part in source[2]], dim=source[1])
    if kind == "stack":
        return torch.stack([read_source(part, get, mxfp4_dtype) for part in source[1]])
    if kind == "transpose":
        return read_source(source[3], get, mxfp4_dtype).transpose(source[1], source[2])
    if kind == "deinterleave":
        return deinterleave(read_source(source[2], get, mxfp4_dtype), source[1])
    if kind == "halves":
        return read_source(source[2], get, mxfp4_dtype).unflatten(source[1], (2, -1))
    if kind == "mxfp4":
        return dequantize_mxfp4(get(source[1]), get(source[2]), mxfp4_dtype)
    raise ValueError(f"Unknown weight source {source!r}.")


def check_leftovers(
    available: Iterable[str], sources: Mapping[str, Source], config: MoETransformerConfig, family: str
) -> None:
    """Raise ``ValueError`` naming the checkpoint tensors that none of ``sources`` reads.

    Layers past ``num_layers`` of a family that declares them (``Family.trailing_layers``:
    DeepSeek's multi-token prediction) are skipped with a warning; a stored tied head and rotary
    tables are ignored.
    """
    used = {name for source in sources.values() for name in source_names(source)}
    if config.tie_embeddings:
        used.add("lm_head.weight")  # stored by some writers; the embedding's values either way
    _check_leftovers(set(available) - used, config, family)


def hf_state_dict(
    get: Callable[[str], Tensor],
    available: Iterable[str],
    config: MoETransformerConfig,
    family: str,
    expected: Iterable[str],
    mxfp4_dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor]:
    """Our state dict (keys ``expected``, a gated fc1 as ``[E, 2, F, H]``) from a Hugging Face
    checkpoint read by ``get(name)``; MXFP4 tensors are dequantised to ``mxfp4_dtype``
    (:func:`~lightning_moe.models.hf.mxfp4.dequantized_dtype` of the directory), every other tensor
    keeps its stored dtype.

    ``available`` are the checkpoint's names: one that maps to nothing is an error naming it,
    except DeepSeek's multi-token-prediction layers (index ``>= num_layers``), skipped with a
    warning because this model does not implement MTP.
    """
    available = set(available)
    sources = hf_sources(available, config, family, expected)
    state = {key: read_source(source, get, mxfp4_dtype) for key, source in sources.items()}
    if is_gated(config.moe.activation):
        for key in state:
            if key.endswith("ffn.experts.fc1_weight"):
                state[key] = fc1_checkpoint_view(state[key])  # read as stored, [E, 2F, H]
    if config.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    check_leftovers(available, sources, config, family)
    return state


def _check_leftovers(leftovers: set[str], config: MoETransformerConfig, family: str) -> None:
    mtp = {k for k in leftovers if (m := _HF_LAYER_KEY.match(k)) and int(m.group(1)) >= config.num_layers}
    trailing = _family(family).trailing_layers
    if mtp and trailing is not None:
        what, why = trailing
        warnings.warn(
            f"Skipped {len(mtp)} tensor(s) of {what} (model.layers.{config.num_layers}.* and later): {why}, "
            "the main model is loaded in full.",
            UserWarning,
            stacklevel=5,
        )
        leftovers = leftovers - mtp
    unexpected = sorted(k for k in leftovers if not _IGNORED.fullmatch(k))
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (f", ... ({len(unexpected)} in all)" if len(unexpected) > 8 else "")
        raise ValueError(
            f"The checkpoint holds tensors this {family} model has no place for: {shown}. Does config.json "
            "describe these weights?"
        )


def hf_pieces(key: str, value: Tensor, config: MoETransformerConfig, family: str) -> dict[str, Tensor]:
    """The Hugging Face on-disk tensors (per-expert keys) of our state-dict entry ``key``: views of
    ``value``, in the order ``save_pretrained`` writes them (nothing for the tied head)."""
    if key == "lm_head.weight" and config.tie_embeddings:
        return {}
    match = _LAYER_KEY.fullmatch(key)
    own = _own_source(_family(family).moe_sources, match, config, family)
    if own is not None:
        if key.endswith("ffn.experts.fc1_weight") and is_gated(config.moe.activation):
            value = fc1_from_checkpoint(value)  # the stored [E, 2F, H] the source describes
        return split_source(own, value)
    block = _block_source(match.group(2), family) if match else None
    if block is not None:
        return split_source(_prefixed(block, f"model.layers.{match.group(1)}.{_moe_prefix(family)}."), value)
    special = _special(match.group(2)) if match else None
    if special is None:
        return {_hf_name(key, config, family): value}
    layer = f"model.layers.{match.group(1)}.{_moe_prefix(family)}"
    gate, up, down = _expert_names(family)
    tensors: dict[str, Tensor] = {}
    for e, expert in enumerate(value):
        if special.endswith("fc1_weight"):
            # [2, F, H] (the state dict's layout) or [2F, H] (an older one): gate, then up.
            gate_rows, up_rows = expert.reshape(2, -1, expert.shape[-1]).unbind(0)
            tensors[f"{layer}.experts.{e}.{gate}.weight"] = gate_rows
            tensors[f"{layer}.experts.{e}.{up}.weight"] = up_rows
        else:
            tensors[f"{layer}.experts.{e}.{down}.weight"] = expert
    return tensors


def hf_defaults(names: Iterable[str], config: MoETransformerConfig, family: str) -> dict[str, Tensor]:
    """Tensors the family always has that a model without them writes as their neutral value
    (DeepSeek-V3's score-correction bias, zeros), for those not among ``names``
    (``Family.weight_defaults``)."""
    make = _family(family).weight_defaults
    return {} if make is None else make(set(names), config)


def hf_tensors(state: Mapping[str, Tensor], config: MoETransformerConfig, family: str) -> dict[str, Tensor]:
    """The Hugging Face on-disk tensors (per-expert keys) of our state dict ``state``."""
    tensors: dict[str, Tensor] = {}
    for key, value in state.items():
        tensors.update(hf_pieces(key, value, config, family))
    tensors.update(hf_defaults(tensors, config, family))
    return tensors
