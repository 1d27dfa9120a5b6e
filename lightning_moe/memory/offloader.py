"""The activation offloader: saved tensors of module boundaries to host memory and back.

:func:`lightning_moe.memory.apply_activation_offload` decides which module boundaries exist
(:mod:`lightning_moe.memory.offload`); this module moves what they save.

Parameters (and views of them, e.g. ``nn.Linear``'s transposed weight), tensors of other
devices, tensor subclasses and storages smaller than ``min_tensor_bytes`` stay where they are
(and reach the enclosing saved-tensor hooks).

Mechanics, per micro-batch (its groups, its warm-up rule, its look-ahead; see the end for how
micro-batches begin):

* Forward: everything a boundary saves is one *group*. A group's copy to host starts when the
  next group of the same name begins (the boundary one layer later): on CUDA on a side stream
  that first waits for the compute stream, into pinned host buffers, then an event is recorded
  and the device references are dropped (``record_stream`` keeps the caching allocator from
  reusing the memory before the copy has read it).
* The warm-up rule of Megatron Core (keep on the device, for each name, the group needed first
  in backward, i.e. the last one produced in forward, so the first reload never stalls) falls
  out of that deferral: when backward starts, the last group of each name has not been
  offloaded and stays. Megatron learns the same set in a warm-up iteration; here it holds from
  the first step on, with the same peak memory.
* Backward: when a group's tensors are first needed, the compute stream waits for its reload
  (issued earlier, or now) and the reload of the next offloaded group in backward order (the
  previous one in forward order) is started on a second side stream: one group of look-ahead.
* On CPU the same code runs with synchronous host-to-host copies; it moves the bytes (so the
  logic is tested) but saves nothing.

A new micro-batch starts when a boundary runs after backward began, or at
:meth:`ActivationOffloader.start_microbatch` (the Lightning callback calls it every batch).
Several micro-batches can be in flight: each group belongs to the micro-batch that produced it,
and a backward of an older one while newer ones exist (pipeline schedules: 1F1B's warm-up,
GPipe, interleaved virtual stages) keeps, reloads and prefetches within its own micro-batch. A
schedule that runs several forwards before their backwards must start a micro-batch at each
forward of each stage (:meth:`~lightning_moe.memory.offload.OffloadHandle.start_microbatch_at`;
the callback does it under ``MoEStrategy`` pipeline parallelism); otherwise those forwards
merge into one micro-batch, only the last forward's last groups stay on the device and the
earlier ones are reloaded on demand (``OffloadStats.reloads_on_demand``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_moe.compat import view_base
from lightning_moe.memory.saved_tensors import NOT_HANDLED, chained_saved_tensors_hooks, storage_of

__all__ = ["ActivationOffloader", "OffloadStats"]


@dataclass
class OffloadStats:
    """Cumulative counters of an :class:`ActivationOffloader` (reset with :meth:`reset`)."""

    offloaded_bytes: int = 0
    reloaded_bytes: int = 0
    offloaded_groups: int = 0
    kept_groups: int = 0
    """Groups left on the device by the warm-up rule (the last of each name in forward)."""
    reloads_on_demand: int = 0
    """Reloads started only when backward needed the group (not prefetched one group ahead);
    the warm-up rule keeps this at zero for a regular layer stack."""
    offloaded_bytes_by_name: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        """Zero every counter."""
        self.offloaded_bytes = self.reloaded_bytes = self.offloaded_groups = self.kept_groups = 0
        self.reloads_on_demand = 0
        self.offloaded_bytes_by_name = {}


class _Entry:
    """One storage of a group: on the device, on the host, or back."""

    __slots__ = ("device", "host", "nbytes", "storage")

    def __init__(self, storage: torch.UntypedStorage, device_bytes: Tensor) -> None:
        self.storage: torch.UntypedStorage | None = storage  # keeps id(storage) unique while grouping
        self.device: Tensor | None = device_bytes  # uint8 view of the whole storage
        self.host: Tensor | None = None
        self.nbytes = storage.nbytes()


class _MicroBatch:
    def __init__(self) -> None:
        self.order: list[weakref.ref] = []
        self.pending: dict[str, _Group] = {}
        self.current: _Group | None = None
        self.backward = False


class _Group:
    """Everything one boundary saved in one forward call."""

    def __init__(self, name: str, key: str, index: int, microbatch: _MicroBatch) -> None:
        self.name, self.key, self.index = name, key, index
        self.microbatch = microbatch
        self.entries: list[_Entry] = []
        self.by_storage: dict[int, _Entry] = {}
        self.state = "device"  # device -> offloaded -> reloading -> device
        self.event = None
        self.prefetched = False

    def add(self, storage: torch.UntypedStorage) -> _Entry:
        entry = self.by_storage.get(id(storage))
        if entry is None:
            device_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            entry = self.by_storage[id(storage)] = _Entry(storage, device_bytes)
            self.entries.append(entry)
        return entry


@dataclass
class _Handle:
    """What autograd keeps for an offloadable saved tensor."""

    group: _Group
    entry: _Entry
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class ActivationOffloader:
    """Moves saved activations of named boundaries to host memory and back (see the module docstring).

    Args:
        device: the device whose activations are offloaded (default: CUDA if available, else CPU).
        min_tensor_bytes: storages smaller than this stay on the device (Megatron's
            ``min_offloaded_tensor_size``, 1M elements, is 2 MiB in bf16).
    """

    def __init__(self, device: torch.device | str | None = None, min_tensor_bytes: int = 1 << 20) -> None:
        if min_tensor_bytes < 0:
            raise ValueError(f"min_tensor_bytes must be >= 0, got {min_tensor_bytes}.")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.min_tensor_bytes = min_tensor_bytes
        self.stats = OffloadStats()
        self._cuda = self.device.type == "cuda"
        self._d2h_stream = None
        self._h2d_stream = None
        self._microbatch = _MicroBatch()

    # ----------------------------------------------------------------------------- public API

    def start_microbatch(self) -> None:
        """Begin a new micro-batch: groups of the last one that are still pending stay on the device.

        The earlier micro-batch stays in flight: its backward may run later, before or after that
        of the new one.
        """
        self._microbatch = _MicroBatch()

    def boundary(self, key: str, name: str | None, names: Sequence[str] = ()) -> _Boundary:
        """A saved-tensor hooks context for the boundary ``key`` (e.g. ``layers.0.attn_norm``).

        ``name`` is the offload name every eligible tensor saved inside belongs to; ``names``
        the names accepted from tensors tagged by the module (``tag``), see :class:`GroupedExperts`.
        """
        return _Boundary(self, key, name, tuple(names))

    @property
    def streams(self) -> tuple:
        """``(device-to-host, host-to-device)`` CUDA streams (None on CPU or before first use)."""
        return self._d2h_stream, self._h2d_stream

    # ------------------------------------------------------------------------------- forward

    def _eligible(self, tensor: Tensor, storage: torch.UntypedStorage | None) -> bool:
        base = tensor if view_base(tensor) is None else view_base(tensor)
        if base.is_leaf and base.requires_grad:
            return False  # parameters (and views such as linear's weight.t()): not activations
        return (
            storage is not None
            and type(tensor) is Tensor
            and tensor.layout == torch.strided
            and tensor.device.type == self.device.type
            and storage.nbytes() >= max(self.min_tensor_bytes, 1)
        )

    def _group_for(self, key: str, name: str) -> _Group:
        microbatch = self._microbatch
        if microbatch.backward:
            microbatch = self._microbatch = _MicroBatch()
        group = microbatch.current
        if group is not None and group.key == key and group.name == name:
            return group
        if group is not None:
            microbatch.pending[group.name] = group
        previous = microbatch.pending.pop(name, None)
        if previous is not None:
            self._offload(previous)
        group = _Group(name, key, len(microbatch.order), microbatch)
        microbatch.order.append(weakref.ref(group))
        microbatch.current = group
        return group

    def _pack(self, tensor: Tensor, key: str, name: str) -> object:
        storage = storage_of(tensor)
        if not self._eligible(tensor, storage):
            return NOT_HANDLED
        group = self._group_for(key, name)
        entry = group.add(storage)
        return _Handle(group, entry, tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tensor.stride())

    def _offload(self, group: _Group) -> None:
        for entry in group.entries:
            entry.storage = None
        if not group.entries:
            return
        if self._cuda:
            if self._d2h_stream is None:
                self._d2h_stream = torch.cuda.Stream(self.device)
            stream = self._d2h_stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for entry in group.entries:
                    entry.host = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=True)
                    entry.host.copy_(entry.device, non_blocking=True)
                    entry.device.record_stream(stream)
                    entry.device = None
                group.event = torch.cuda.Event()
                group.event.record(stream)
        else:
            for entry in group.entries:
                entry.host = entry.device.clone()  # synchronous: the logic of the CUDA path, no saving
                entry.device = None
        group.state = "offloaded"
        nbytes = sum(entry.nbytes for entry in group.entries)
        stats = self.stats
        stats.offloaded_bytes += nbytes
        stats.offloaded_groups += 1
        stats.offloaded_bytes_by_name[group.name] = stats.offloaded_bytes_by_name.get(group.name, 0) + nbytes

    # ------------------------------------------------------------------------------ backward

    def _begin_backward(self, microbatch: _MicroBatch) -> None:
        if microbatch.current is not None:
            microbatch.pending[microbatch.current.name] = microbatch.current
            microbatch.current = None
        for group in microbatch.pending.values():
            for entry in group.entries:
                entry.storage = None
        self.stats.kept_groups += sum(1 for g in microbatch.pending.values() if g.entries)
        microbatch.pending = {}
        microbatch.backward = True

    def _reload(self, group: _Group) -> None:
        if self._cuda:
            if self._h2d_stream is None:
                self._h2d_stream = torch.cuda.Stream(self.device)
            stream = self._h2d_stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            stream.wait_event(group.event)
            with torch.cuda.stream(stream):
                for entry in group.entries:
                    entry.device = torch.empty(entry.nbytes, dtype=torch.uint8, device=self.device)
                    entry.device.copy_(entry.host, non_blocking=True)
                group.event = torch.cuda.Event()
                group.event.record(stream)
        else:
            for entry in group.entries:
                entry.device = entry.host.clone()
        group.state = "reloading"
        self.stats.reloaded_bytes += sum(entry.nbytes for entry in group.entries)

    def _wait(self, group: _Group) -> None:
        if self._cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(group.event)
            for entry in group.entries:
                entry.device.record_stream(current)  # allocated on the reload stream, used here
        for entry in group.entries:
            entry.host = None  # pinned blocks return to torch's host cache after their copies
        group.state = "device"

    def _prefetch_before(self, group: _Group) -> None:
        if group.prefetched:
            return
        group.prefetched = True
        order = group.microbatch.order
        for index in range(group.index - 1, -1, -1):
            earlier = order[index]()
            if earlier is not None and earlier.state == "offloaded":
                self._reload(earlier)
                return

    def _unpack(self, handle: _Handle) -> Tensor:
        group = handle.group
        if not group.microbatch.backward:
            self._begin_backward(group.microbatch)
        if group.state == "offloaded":
            self.stats.reloads_on_demand += 1
            self._reload(group)
        if group.state == "reloading":
            self._wait(group)
        self._prefetch_before(group)
        device_bytes = handle.entry.device
        view = torch.empty(0, dtype=handle.dtype, device=device_bytes.device)
        return view.set_(device_bytes.untyped_storage(), handle.offset, handle.size, handle.stride)


class _Boundary:
    """Forward pre/post hooks (or a ``with`` block) that route a boundary's saved tensors to the offloader."""

    def __init__(self, offloader: ActivationOffloader, key: str, name: str | None, names: tuple[str, ...]):
        self.offloader, self.key, self.name, self.names = offloader, key, name, names
        self._frames: list[dict[int, tuple[str | None, torch.UntypedStorage]]] = []
        self._hooks: list = []

    def tag(self, name: str | None, tensors: Sequence[Tensor]) -> None:
        """Record that ``tensors`` (their storages) belong to boundary ``name`` (None: never offloaded)."""
        if not self._frames:
            return
        tags = self._frames[-1]
        for tensor in tensors:
            storage = storage_of(tensor)
            if storage is not None:
                tags.setdefault(id(storage), (name, storage))

    def _pack(self, tensor: Tensor) -> object:
        name = self.name
        if self._frames:
            storage = storage_of(tensor)
            tagged = self._frames[-1].get(id(storage)) if storage is not None else None
            if tagged is not None:
                name = tagged[0] if tagged[0] in self.names else None
        if name is None:
            return NOT_HANDLED
        return self.offloader._pack(tensor, self.key, name)

    def enter(self, *args: object) -> None:
        """Start the boundary (a forward pre-hook's signature is accepted)."""
        self._frames.append({})
        hooks = chained_saved_tensors_hooks(self._pack, self.offloader._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)

    def exit(self, *args: object) -> None:
        """End the boundary (a forward hook's signature is accepted)."""
        self._hooks.pop().__exit__(None, None, None)
        self._frames.pop()

    def __enter__(self) -> _Boundary:
        self.enter()
        return self

    def __exit__(self, *args: object) -> None:
        self.exit()
