"""`load_hf_weights`: a Hugging Face model directory into a parallelised model, each rank reading its slices.

Run after :func:`~lightning_moe.parallel.parallelize` and materialisation (``MoELanguageModel(init_from=...)``
calls it when training starts). For every parameter and persistent buffer of the model, this
rank's block of the *global* tensor is worked out from how the layout holds it, and only that
block is read from the safetensors files (``safe_open(...).get_slice``), so no rank ever holds
the whole model:

* a plain tensor (replicated): the whole tensor;
* a DTensor (tensor parallelism, FSDP2's dense sharding over DP, both): the local shard
  ``compute_local_shape_and_global_offset`` gives;
* an expert tensor (:func:`~lightning_moe.parallel.expert_parallel.expert_shard`): this EP rank's
  experts, each cut to its ETP block of F (a gated fc1 holds a block of the gate rows and one of
  the up rows) and, under sharded data parallelism, to its EDP block of H.

Hugging Face names map through :mod:`lightning_moe.models.hf.weights`: a stacked expert tensor reads
only the local experts' per-expert tensors (or the slice of ``transformers`` 5's fused ones), the
shared expert's fc1 its gate and up rows, an MXFP4 tensor (GPT-OSS's experts) only the packed
bytes and scales of its block, dequantised to the experts' dtype. The block is copied into the local tensor in place (the
optimizer's references stay valid), cast to the parameter's dtype. Every parameter and buffer must
be filled and every tensor of the directory used (DeepSeek's multi-token-prediction layers are
skipped with a warning); the errors name the tensor. A model trimmed to its pipeline stages
(:func:`~lightning_moe.parallel.pipeline.split.trim_to_stages`) reads only its stages' tensors, and
"used" counts the whole model's: another stage's tensor is fine, one no stage takes is an error.
No communication: ranks read independently.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_moe.compat import compute_local_shape_and_global_offset
from lightning_moe.lora.apply import is_adapter_key
from lightning_moe.models import MoETransformer
from lightning_moe.models.hf.config_map import config_from_hf
from lightning_moe.models.hf.io import SafetensorsReader, read_config
from lightning_moe.models.hf.mxfp4 import VALUES_PER_BLOCK, dequantize_mxfp4, mxfp4_shape
from lightning_moe.models.hf.weights import Source, check_leftovers, hf_sources
from lightning_moe.parallel.expert_parallel import expert_shard, ffn_block_ranges
from lightning_moe.parallel.pipeline.split import trim_record

__all__ = ["load_hf_weights", "local_ranges"]

Ranges = list[list[tuple[int, int]]]
"""Per dimension, the (start, stop) ranges of the global tensor held locally, in local order."""


def _sub_ranges(ranges: list[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """The global ranges of positions ``[start, stop)`` of the concatenation of ``ranges``."""
    out, position = [], 0
    for a, b in ranges:
        lo, hi = max(start, position), min(stop, position + b - a)
        if lo < hi:
            out.append((a + lo - position, a + hi - position))
        position += b - a
    return out


def _dtensor_ranges(tensor: DTensor, ranges: Ranges) -> Ranges:
    """``ranges`` of the DTensor's global tensor narrowed to this rank's local shard of it."""
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return [_sub_ranges(r, o, o + s) for r, o, s in zip(ranges, offset, shape)]


def local_ranges(tensor: Tensor) -> tuple[tuple[int, ...], Ranges]:
    """``(global shape, ranges)``: the global tensor ``tensor`` is this rank's part of, and where.

    See the module docstring; the ranges concatenated in each dimension give the local tensor.
    """
    spec = expert_shard(tensor)
    if spec is None:
        shape = tuple(tensor.shape)  # a DTensor's shape is the global one
        ranges = [[(0, size)] for size in shape]
        return shape, _dtensor_ranges(tensor, ranges) if isinstance(tensor, DTensor) else ranges
    shape = spec.global_shape
    ranges = [[(0, size)] for size in shape]
    num_local = tensor.shape[0]  # the FSDP2 DTensor over EDP keeps the local experts whole
    ranges[0] = [(spec.expert_offset, spec.expert_offset + num_local)]
    if spec.ffn_dim is not None and spec.ffn_size > 1:
        ranges[spec.ffn_dim] = ffn_block_ranges(spec, shape[spec.ffn_dim])
    if isinstance(tensor, DTensor):  # sharded data parallelism: this rank's block of H
        ranges = _dtensor_ranges(tensor, ranges)
    return shape, ranges


class _SliceReader:
    """Shapes and sliced reads of the :data:`~lightning_moe.models.hf.weights.Source` s of one directory."""

    def __init__(self, reader: SafetensorsReader, mxfp4_dtype: torch.dtype = torch.float32) -> None:
        self.reader = reader
        self.mxfp4_dtype = mxfp4_dtype  # what MXFP4 blocks are dequantised to
        self.bytes_read = 0

    def shape(self, source: Source) -> tuple[int, ...]:
        if isinstance(source, str):
            return tuple(self.reader.get_slice(source).get_shape())
        kind = source[0]
        if kind == "stack":
            return (len(source[1]), *self.shape(source[1][0]))
        if kind == "mxfp4":
            return mxfp4_shape(self.shape(source[1]), self.shape(source[2]))
        if kind == "transpose":
            shape = list(self.shape(source[3]))
            shape[source[1]], shape[source[2]] = shape[source[2]], shape[source[1]]
            return tuple(shape)
        if kind == "deinterleave":
            return self.shape(source[2])
        if kind == "halves":
            shape, dim = self.shape(source[2]), source[1]
            return (*shape[:dim], 2, shape[dim] // 2, *shape[dim + 1 :])
        dim, parts = source[1], source[2]
        shapes = [self.shape(part) for part in parts]
        return (*shapes[0][:dim], sum(s[dim] for s in shapes), *shapes[0][dim + 1 :])

    def read(self, source: Source, ranges: Ranges) -> Tensor:
        """The local tensor: every combination of ``ranges`` read and concatenated in order."""
        # A de-interleaved dimension reads its pieces together: an ETP rank's gate block and up
        # block are the even and odd positions of one span of the checkpoint's interleaved rows.
        joint = source[1] if isinstance(source, tuple) and source[0] == "deinterleave" else None
        for dim, pieces in enumerate(ranges):
            if len(pieces) != 1 and dim != joint:
                parts = [self.read(source, [*ranges[:dim], [piece], *ranges[dim + 1 :]]) for piece in pieces]
                return torch.cat(parts, dim=dim)
        if joint is not None:
            return self._read_deinterleaved(source[2], joint, ranges)
        return self._read_box(source, [pieces[0] for pieces in ranges])

    def _slice(self, name: str, box: list[tuple[int, int]]) -> Tensor:
        block = self.reader.get_slice(name)[tuple(slice(a, b) for a, b in box)]
        self.bytes_read += block.numel() * block.element_size()
        return block

    def _read_box(self, source: Source, box: list[tuple[int, int]]) -> Tensor:
        if isinstance(source, str):
            return self._slice(source, box)
        kind = source[0]
        if kind == "stack":
            (a, b), rest = box[0], box[1:]
            return torch.stack([self._read_box(source[1][e], rest) for e in range(a, b)])
        if kind == "mxfp4":
            return self._read_mxfp4(source[1], source[2], box)
        if kind == "transpose":
            d0, d1 = source[1], source[2]
            swapped = list(box)
            swapped[d0], swapped[d1] = box[d1], box[d0]
            return self._read_box(source[3], swapped).transpose(d0, d1)
        if kind == "deinterleave":
            return self._read_deinterleaved(source[2], source[1], [[r] for r in box])
        if kind == "halves":
            dim, part = source[1], source[2]
            half = self.shape(part)[dim] // 2
            (i0, i1), (a, b) = box[dim], box[dim + 1]
            # Both halves' pieces in one read: of an interleaved part (GPT-OSS's gate/up bias) one span
            # of position pairs holds the gate piece and the up piece, read once rather than twice.
            pieces = [(i * half + a, i * half + b) for i in range(i0, i1)]
            ranges = [[r] for r in box[:dim]] + [pieces] + [[r] for r in box[dim + 2 :]]
            return self.read(part, ranges).unflatten(dim, (i1 - i0, b - a))
        dim, parts = source[1], source[2]
        a, b = box[dim]
        blocks, position = [], 0
        for part in parts:
            size = self.shape(part)[dim]
            lo, hi = max(a, position), min(b, position + size)
            if lo < hi:
                blocks.append(self._read_box(part, [*box[:dim], (lo - position, hi - position), *box[dim + 1 :]]))
            position += size
        return torch.cat(blocks, dim=dim)


    def _read_deinterleaved(self, part: Source, dim: int, ranges: Ranges) -> Tensor:
        """Positions ``ranges[dim]`` of ``[even positions ; odd positions]`` of ``part`` along ``dim``
        (one range in every other dimension), read as one span of ``part``'s position pairs."""
        half = self.shape(part)[dim] // 2
        wanted = []  # (parity, first pair, last pair + 1) of each piece, in order
        for a, b in ranges[dim]:
            for parity, (lo, hi) in enumerate(((a, min(b, half)), (max(a, half) - half, b - half))):
                if lo < hi:
                    wanted.append((parity, lo, hi))
        first, last = min(w[1] for w in wanted), max(w[2] for w in wanted)
        box = [pieces[0] for pieces in ranges]
        box[dim] = (2 * first, 2 * last)
        pairs = self._read_box(part, box).unflatten(dim, (-1, 2))
        return torch.cat([pairs.narrow(dim, lo - first, hi - lo).select(dim + 1, parity)
                          for parity, lo, hi in wanted], dim=dim)

    def _read_mxfp4(self, blocks: str, scales: str, box: list[tuple[int, int]]) -> Tensor:
        """A box ``[experts, columns, rows]`` of a dequantised MXFP4 tensor, reading only the packed
        groups of 32 columns that cover it."""
        (e0, e1), (c0, c1), (r0, r1) = box
        g0, g1 = c0 // VALUES_PER_BLOCK, -(-c1 // VALUES_PER_BLOCK)
        # Blocks are [E, R, G, 16], or [E, R, G * 16] with each block's bytes in the last dimension.
        per_group = 1 if len(self.shape(blocks)) == 4 else VALUES_PER_BLOCK // 2
        packed = self._slice(blocks, [(e0, e1), (r0, r1), (g0 * per_group, g1 * per_group)])
        exponents = self._slice(scales, [(e0, e1), (r0, r1), (g0, g1)])
        return dequantize_mxfp4(packed, exponents, self.mxfp4_dtype).narrow(1, c0 - g0 * VALUES_PER_BLOCK, c1 - c0)


def _persistent_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Every parameter (a tied one once) and persistent buffer of ``model``, by state-dict key; LoRA
    adapters are not pretrained weights and are left out."""
    yield from ((name, param) for name, param in model.named_parameters() if not is_adapter_key(name))
    for prefix, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buffer


def _whole_model_keys(config) -> list[str]:
    """The state-dict keys of the whole :class:`MoETransformer` of ``config`` (a pipeline stage holds some).

    Built on the meta device (no memory) with the CPU RNG restored afterwards: building a MoE layer
    draws its seed from it, and the real model's later draws must not change.
    """
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        whole = MoETransformer(config)
    return [key for key, _ in _persistent_tensors(whole)]


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | os.PathLike) -> int:
    """Fill every weight of ``model`` (a :class:`~lightning_moe.models.MoETransformer`, parallelised
    or not, materialised) with its slice of the Hugging Face directory ``path``; return the bytes read.

    The model must have the architecture of the directory's ``config.json`` (its family's names
    are read from it); a tensor whose global shape differs, a weight the directory lacks and a
    tensor of the directory that no weight takes are errors naming them.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "moe_layers"):
        raise TypeError(
            f"load_hf_weights needs a lightning_moe MoETransformer (with .config), got {type(model).__name__}."
        )
    if any(t.is_meta for _, t in _persistent_tensors(model)):
        raise RuntimeError(
            "load_hf_weights writes into the model's tensors, but some are still on the meta device: "
            "materialise the model first (MoEStrategy does so in its setup; else model.to_empty(device=...))."
        )
    _, family = config_from_hf(read_config(path))
    tensors = dict(_persistent_tensors(model))
    expected = list(tensors) + (["lm_head.weight"] if config.tie_embeddings and "lm_head.weight" not in tensors else [])
    with SafetensorsReader(path) as files:
        sources = hf_sources(files.keys(), config, family, expected)
        # A pipeline stage reads its own tensors; the other stages' are not leftovers, a tensor no stage takes is.
        whole = expected if trim_record(model) is None else _whole_model_keys(config)
        check_leftovers(files.keys(), hf_sources(files.keys(), config, family, whole), config, family)
        missing = sorted(set(tensors) - set(sources))
        if missing:
            raise ValueError(f"{path} has no tensor for {', '.join(missing[:8])} of the model.")
        # MXFP4 experts straight in the model's expert dtype (no wider copy of the block first).
        experts = [t.dtype for k, t in tensors.items() if k.endswith("experts.fc1_weight")]
        reader = _SliceReader(files, experts[0] if experts else torch.float32)
        for key, tensor in tensors.items():
            shape, ranges = local_ranges(tensor)
            stored = reader.shape(sources[key])
            if stored != shape:
                raise ValueError(
                    f"{key}: the model's global shape is {shape} but {path} holds {stored} ({sources[key] if isinstance(sources[key], str) else 'assembled'}): "
                    "the model was not built from this directory's config.json."
                )
            local = _local(tensor)
            if local.numel() == 0:
                continue  # an empty shard of an uneven split
            block = reader.read(sources[key], ranges)
            if block.shape != local.shape:
                raise RuntimeError(f"{key}: read a block of shape {tuple(block.shape)} for a local shard of {tuple(local.shape)}.")
            local.copy_(block)
    return reader.bytes_read
