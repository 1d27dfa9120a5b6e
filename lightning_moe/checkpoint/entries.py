"""DCP's ``.metadata`` entries are checked before anything is allocated or read from them.

A crafted ``.metadata`` is a list of promises: "tensor ``w`` has this shape, its chunks are these,
chunk ``i`` lies at these bytes of that file". Trusted as they are, they make a load allocate what
the file asks for (an export built ``torch.empty`` of any declared shape), leave parts of a tensor
unread (uninitialised memory in an export, a fresh initialisation on resume) or read the same
bytes into many chunks. :func:`check_storage` holds every entry to what the files can back:

* every tensor entry has non-negative integer sizes and a known dtype, and its chunks lie inside
  it, do not overlap, and cover it exactly (the summed chunk volumes equal its element count);
* every chunk has a storage record, and that record's bytes hold at least the chunk's raw data
  (DCP stores each chunk as a ``torch.save`` blob, so never less);
* storage records of one file do not overlap, so the declared tensor bytes never exceed the
  bytes of the files (whose sizes :func:`~lightning_moe.checkpoint.integrity.check_complete`
  checked);
* ``planner_data`` paths (how an export rebuilds the nesting) are the key's own parts, with list
  indices no larger than the number of entries.

:func:`check_entries` then compares the entries with the state being loaded: every key the model
and optimizer hold is a tensor entry of the same global shape and dtype, and (for a model loaded
strictly on every rank) no model key is left over. Costs: a pass over the entries, no file read.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from lightning_moe.checkpoint.integrity import DCP_METADATA, CheckpointIntegrityError

__all__ = ["check_entries", "check_storage", "expected_entries"]

_SHOWN = 5
"""Keys named in an error before "and N more"."""


def _ints(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        return None
    return tuple(value)


def _fail(source: Path, message: str) -> CheckpointIntegrityError:
    return CheckpointIntegrityError(f"{source}: {message}; the checkpoint was crafted or damaged. Use another checkpoint.")


def _check_chunks(fqn: str, size: tuple[int, ...], chunks: Any, source: Path) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    if not isinstance(chunks, list):
        raise _fail(source, f"the entry {fqn!r} has no chunk list")
    boxes = []
    for chunk in chunks:
        offsets, sizes = _ints(getattr(chunk, "offsets", None)), _ints(getattr(chunk, "sizes", None))
        if offsets is None or sizes is None or len(offsets) != len(size) or len(sizes) != len(size):
            raise _fail(source, f"a chunk of {fqn!r} has offsets/sizes that do not fit its shape {list(size)}")
        if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise _fail(source, f"a chunk of {fqn!r} at {list(offsets)} of size {list(sizes)} lies outside its shape {list(size)}")
        boxes.append((offsets, sizes))
    covered = sum(math.prod(s) for _, s in boxes)
    if covered != math.prod(size):
        raise _fail(source, f"the chunks of {fqn!r} cover {covered} of its {math.prod(size)} elements (shape {list(size)})")
    # Disjoint chunks whose volumes add up to the whole cover it exactly; compare only chunks whose
    # first-dimension ranges meet (a grid of shards is near linear).
    if size and len(boxes) > 1:
        ordered = sorted(boxes)
        for i, (off_a, size_a) in enumerate(ordered):
            for j in range(i + 1, len(ordered)):
                off_b, size_b = ordered[j]
                if off_b[0] >= off_a[0] + size_a[0]:
                    break
                if all(ob < oa + sa and oa < ob + sb for oa, sa, ob, sb in zip(off_a, size_a, off_b, size_b)):
                    raise _fail(source, f"two chunks of {fqn!r} overlap (at {list(off_a)} and {list(off_b)})")
    return boxes


def _check_planner_data(metadata: Any, source: Path) -> None:
    paths = getattr(metadata, "planner_data", None)
    if paths is None:
        return
    if not isinstance(paths, dict):
        raise _fail(source, f"planner_data is a {type(paths).__name__}, not a dict")
    limit = len(metadata.state_dict_metadata)
    for fqn, path in paths.items():
        ok = isinstance(path, (tuple, list)) and len(path) > 0 and all(
            isinstance(p, str) or (type(p) is int and 0 <= p <= limit) for p in path
        )
        if not ok or ".".join(map(str, path)) != fqn:
            raise _fail(source, f"planner_data gives {fqn!r} the path {str(path)[:200]}, which is not made of its own parts")


def check_storage(metadata: Any, checkpoint: Path) -> None:
    """Raise :class:`CheckpointIntegrityError` unless every entry of ``metadata`` (DCP's metadata of
    the checkpoint folder ``checkpoint``) is backed by the files as the module docstring says."""
    source = Path(checkpoint) / DCP_METADATA
    entries, storage = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise _fail(source, "state_dict_metadata or storage_data is not a dict")
    for info in storage.values():
        if type(getattr(info, "offset", None)) is not int or type(getattr(info, "length", None)) is not int \
                or info.offset < 0 or info.length < 0:
            raise _fail(source, f"a storage record has no valid byte range ({info!r})")
    for fqn, item in entries.items():
        if isinstance(item, BytesStorageMetadata):
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise _fail(source, f"the entry {fqn!r} has an unknown kind {type(item).__name__}")
        size = _ints(getattr(item, "size", None))
        dtype = getattr(getattr(item, "properties", None), "dtype", None)
        if size is None or not isinstance(dtype, torch.dtype):
            raise _fail(source, f"the entry {fqn!r} has no valid shape and dtype")
        itemsize = dtype.itemsize
        for offsets, sizes in _check_chunks(fqn, size, item.chunks, source):
            info = storage.get(MetadataIndex(fqn, offsets))
            if info is None:
                raise _fail(source, f"the chunk of {fqn!r} at {list(offsets)} has no storage record")
            if math.prod(sizes) * itemsize > info.length:
                raise _fail(
                    source, f"the chunk of {fqn!r} at {list(offsets)} needs {math.prod(sizes) * itemsize} bytes but "
                    f"its record in {info.relative_path} holds {info.length}",
                )
    by_file: dict[str, list[tuple[int, int]]] = {}
    for info in storage.values():
        by_file.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
    for name, ranges in by_file.items():
        ranges.sort()
        for (_, end), (start, _) in itertools.pairwise(ranges):
            if start < end:
                raise _fail(source, f"two storage records overlap in {name} (bytes {start} to {end} are read twice)")
    _check_planner_data(metadata, source)


def expected_entries(templates: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{flat key: (global shape, dtype)}`` of every tensor in the nested ``templates`` (DCP's keys)."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Tensor):
            out[prefix] = (tuple(value.shape), value.dtype)  # a DTensor's shape is global
        elif isinstance(value, dict):
            for key, child in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), child)

    walk("", templates)
    return out


def _named(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in sorted(keys)[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def check_entries(
    metadata: Any, expected: dict[str, tuple[tuple[int, ...], torch.dtype]], checkpoint: Path, exact_prefix: str | None
) -> None:
    """Raise unless ``metadata`` holds a tensor entry of the same shape and dtype for every key of
    ``expected`` (:func:`expected_entries` of the state being loaded) and, when ``exact_prefix`` is
    given, no tensor entry under that prefix that ``expected`` lacks."""
    source = Path(checkpoint) / DCP_METADATA
    entries = metadata.state_dict_metadata
    missing, mismatched = [], []
    for fqn, (shape, dtype) in expected.items():
        item = entries.get(fqn)
        if item is None:
            missing.append(fqn)
        elif isinstance(item, TensorStorageMetadata) and (tuple(item.size) != shape or item.properties.dtype != dtype):
            mismatched.append(f"{fqn!r} is {list(item.size)} {item.properties.dtype}, the model has {list(shape)} {dtype}")
        # A bytes entry where the state holds a tensor: SafeLoadPlanner refuses it, naming the key.
    if missing:
        raise CheckpointIntegrityError(f"{source} has no entry for {_named(missing)}: it is not a checkpoint of this "
                                       "model and optimizer (or was altered).")
    if mismatched:
        raise CheckpointIntegrityError(f"{source}: {'; '.join(mismatched[:_SHOWN])}: it is not a checkpoint of this "
                                       "model (or was altered).")
    if exact_prefix is not None:
        extra = [k for k, v in entries.items() if k.startswith(exact_prefix) and k not in expected
                 and isinstance(v, TensorStorageMetadata)]
        if extra:
            raise CheckpointIntegrityError(
                f"{source} holds {_named(extra)}, which the model does not have: it is a checkpoint of another model "
                "(or was altered). Load with strict_loading=False to ignore them."
            )
