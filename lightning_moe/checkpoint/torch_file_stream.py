"""A ``torch.save`` file written tensor by tensor, so no process holds the whole object at once.

``torch.save`` pickles the whole object first and then writes every storage, so everything it
saves must be in memory together. Its file is a zip archive read through the central directory at
its end: the order of the records does not matter to ``torch.load``. :class:`TorchFileStream`
uses that: :meth:`~TorchFileStream.add` writes one tensor's bytes as the record ``data/<key>``
right away and returns a small :class:`StoredTensor` stand-in; :meth:`~TorchFileStream.finish`
pickles the object holding the stand-ins (each pickles exactly as ``torch.save`` pickles a
tensor: ``torch._utils._rebuild_tensor_v2`` of a persistent ``("storage", <dtype>Storage, key,
"cpu", numel)``) as ``data.pkl`` and closes the archive. The file loads with ``torch.load(...,
weights_only=True)`` (and ``mmap=True``: records keep ``torch.save``'s storage alignment), with
every tensor on the CPU. The caller frees each tensor after :meth:`~TorchFileStream.add`, so
the memory held is one tensor, plus a copy of it when it is not a contiguous CPU tensor that
owns its storage.

``torch.save``'s ``.format_version`` record is left out on purpose: it promises that storages lie
in the file in the order the pickle meets them (an optional fast path of ``torch.load``), which
a stream cannot promise for tensors outside the streamed ones; without it ``torch.load`` reads each
record's offset from the archive, as for files of torch before 2.1.
"""

from __future__ import annotations

import collections
import contextlib
import io
import pickle
import sys
import weakref
from typing import IO, Any

import torch
from torch import Tensor

from lightning_moe import compat

__all__ = ["StoredTensor", "TorchFileStream"]

_PICKLE_PROTOCOL = 2
"""``torch.save``'s default protocol (``torch.serialization.DEFAULT_PROTOCOL``)."""


class _StoredStorage:
    """The persistent id of a storage already written as ``data/<key>``."""

    def __init__(self, dtype: torch.dtype, key: str, numel: int) -> None:
        self.storage_type = getattr(torch, compat.storage_type_name(dtype))
        self.key, self.numel = key, numel


class StoredTensor:
    """Stand-in for a tensor whose bytes :meth:`TorchFileStream.add` wrote: pickles as that tensor."""

    def __init__(self, storage: _StoredStorage, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> None:
        self._storage, self.shape, self.dtype = storage, shape, dtype
        self._stride = stride

    def __reduce_ex__(self, protocol: int):
        # Tensor._reduce_ex_internal's form for a plain CPU tensor without hooks or metadata.
        return compat.tensor_rebuild_function(), (
            self._storage, 0, tuple(self.shape), self._stride, False, collections.OrderedDict(),
        )


class _Pickler(pickle.Pickler):
    def __init__(self, file: IO[bytes], stream: TorchFileStream) -> None:
        super().__init__(file, protocol=_PICKLE_PROTOCOL)
        self.stream = stream

    def persistent_id(self, obj: Any):
        if isinstance(obj, _StoredStorage):
            return "storage", obj.storage_type, obj.key, "cpu", obj.numel
        if isinstance(obj, torch.storage.TypedStorage):  # a tensor left in the object: written now, as torch.save does
            return self.stream._storage_id(obj)
        return None


class TorchFileStream:
    """Writes a ``torch.save``-compatible file into ``file`` (an open binary file), tensor by tensor.

    Use :meth:`add` for the tensors, in any order, then :meth:`finish` once with the object to
    save, its tensors replaced by what :meth:`add` returned; or :meth:`abandon` after a failure.
    Tensors left in that object are written by :meth:`finish` as ``torch.save`` writes them (all
    at once: keep only small ones there). The caller flushes and closes ``file``.
    """

    def __init__(self, file: IO[bytes]) -> None:
        self._zip = compat.torch_zip_writer(file)
        self._count = 0
        self._same: dict[tuple, tuple[weakref.ref, StoredTensor]] = {}
        self._storages: dict[int, str] = {}  # storages of tensors left in the object given to finish

    def add(self, tensor: Tensor) -> StoredTensor:
        """Write ``tensor``'s data now (copied to the CPU if needed) and return its stand-in.

        A tensor viewing the same data as one added before (tied weights) is written once and
        loads sharing its storage, as with ``torch.save``.
        """
        tensor = tensor.detach()
        storage = tensor.untyped_storage()
        identity = (tensor.device, storage.data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride(),
                    tensor.dtype)
        earlier = self._same.get(identity)
        if earlier is not None and earlier[0]() is storage:  # still alive: the same data, not a reused address
            return earlier[1]
        data = tensor.to("cpu")
        if not data.is_contiguous() or data.storage_offset() != 0 or data.untyped_storage().nbytes() != data.nbytes:
            data = data.clone(memory_format=torch.contiguous_format)  # only this tensor's bytes
        key = str(self._count)
        self._count += 1
        self._zip.write_record(f"data/{key}", data.untyped_storage(), data.nbytes)
        stored = StoredTensor(_StoredStorage(tensor.dtype, key, tensor.numel()), tensor.shape, data.stride(),
                              tensor.dtype)
        if storage.data_ptr() != 0:
            self._same[identity] = (weakref.ref(storage), stored)
        return stored

    def _storage_id(self, typed: torch.storage.TypedStorage) -> tuple:
        storage, type_name, size = compat.typed_storage_parts(typed)
        key = self._storages.get(compat.storage_identity(storage))
        if key is None:
            key = self._storages[compat.storage_identity(storage)] = str(self._count)
            self._count += 1
            data = storage.cpu()
            self._zip.write_record(f"data/{key}", data, data.nbytes())
        return "storage", getattr(torch, type_name), key, "cpu", size

    def finish(self, obj: Any) -> None:
        """Pickle ``obj`` (tensors as :class:`StoredTensor`) as the archive's ``data.pkl`` and close it."""
        buffer = io.BytesIO()
        _Pickler(buffer, self).dump(obj)
        data = buffer.getvalue()
        self._zip.write_record("data.pkl", data, len(data))
        alignment = str(compat.storage_alignment())
        self._zip.write_record(".storage_alignment", alignment, len(alignment))
        self._zip.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        self._close()  # the zip's central directory; flushes ``file``

    def _close(self) -> None:
        self._zip.write_end_of_file()

    def abandon(self) -> None:
        """Close the archive after a failure, ignoring further write errors (the file is incomplete).

        Needed once :meth:`finish` will not be called: the writer otherwise closes the archive when
        it is garbage collected, and a write error there aborts the process.
        """
        with contextlib.suppress(Exception):  # the first error is the one to report
            self._close()
