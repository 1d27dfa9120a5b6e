"""`StepProbe`: the collectives, host reads and live bytes of everything run inside it.

A ``TorchDispatchMode`` above ``FakeTensorMode`` (the planner, `lightning_moe.planning`, and the scale
tests run a training step under it):

* collectives: every op of `COLLECTIVE_NAMESPACES` (``c10d``, functional
  collectives, DTensor's own), classified by kind, with the members of its group, whether
  it ran in forward or backward and the model part it ran in (``ModTracker``), and the product
  file that issued it (``grad_sync.py``, ``grad_norm.py``, ...). DTensor ops are let through first
  (the mode returns ``NotImplemented`` for them, as torch's ``CommDebugMode`` does), so the
  redistributions DTensor makes inside an op are seen too. Collectives issued by a module's own
  forward hooks (a DTensor output layout) run after ``ModTracker`` has left the module and are
  attributed to its parent;
* host reads: ``aten._local_scalar_dense`` (``.item()``, ``bool()``) and ``.tolist()`` (counted as
  one read, as on a GPU where it is one device-to-host copy), and ``torch.cuda.synchronize``. A
  fake tensor has no value, so every read is answered from ``answers``, keyed by the product
  function that reads (``"alltoall.py:_counts"``); a read anywhere else raises, naming its site.
  Reads in ``torch.optim`` (Adam's step counter, a host tensor unless ``capturable``/``fused``)
  and reads of real tensors (made outside ``FakeTensorMode``) are counted apart: they are no
  device synchronisation;
* bytes: the live bytes of every storage, from the tensors `StepProbe.adopt` is given to
  everything ops create, and their peak per phase. The probe is a `lightning_moe.planning.live_bytes.LiveBytes`
  (the counter of the setup tests), so setup, step and save are counted alike; a meta tensor
  allocates nothing. DTensor's shape propagation (it runs each new op once on global-shape fake
  tensors, which pass through this mode under an outer ``FakeTensorMode``) is not counted: a real
  run allocates nothing for it. (``torch.distributed._tools.mem_tracker.MemTracker`` refuses a
  module called more than once per context, as gradient accumulation does.)

What it cannot see: device-to-host copies other than the reads above (everything is on the CPU
here), GPU streams, NCCL buffers, allocator caching and fragmentation.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import lightning_moe
from lightning_moe.compat import (
    FakeTensor,
    ModTracker,
    host_read_op,
    is_traceable_wrapper_subclass,
    patch_tensor_meta_propagation,
    resolve_process_group,
    script_object_kind,
    storage_identity,
    tree_flatten,
    unbox_process_group,
    unset_fake_temporarily,
)
from lightning_moe.planning.live_bytes import LiveBytes
from lightning_moe.planning.wire_bytes import sent_bytes

__all__ = ["COLLECTIVE_NAMESPACES", "Collective", "HostRead", "StepProbe", "StepRecord"]

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")
"""Op namespaces of process-group communication (eager ``dist.*`` calls and functional collectives)."""

_PACKAGE = os.path.dirname(os.path.abspath(lightning_moe.__file__)) + os.sep
# The planner drives a training step from here: its frames are not the product's reading sites.
_PLANNING = os.path.join(_PACKAGE, "planning") + os.sep
# Where the token dispatchers' buffers are made (StepRecord.peak_dispatch_bytes).
_DISPATCH = (os.path.join(_PACKAGE, "parallel", "dispatchers") + os.sep, os.path.join(_PACKAGE, "parallel", "collectives.py"))
_OPTIM = os.sep + os.path.join("torch", "optim") + os.sep

# Collective ops by kind (in-place c10d ops of torch.distributed, and the functional ops DTensor uses).
_KINDS = {
    "all_to_all": ("c10d.alltoall_base_", "c10d.alltoall_", "_c10d_functional.all_to_all_single"),
    "all_gather": (
        "c10d._allgather_base_", "c10d.allgather_", "c10d.allgather_into_tensor_coalesced_",
        "_c10d_functional.all_gather_into_tensor", "_c10d_functional.all_gather_into_tensor_coalesced",
    ),
    "reduce_scatter": (
        "c10d._reduce_scatter_base_", "c10d.reduce_scatter_", "c10d.reduce_scatter_tensor_coalesced_",
        "_c10d_functional.reduce_scatter_tensor", "_c10d_functional.reduce_scatter_tensor_coalesced",
    ),
    "all_reduce": (
        "c10d.allreduce_", "c10d.allreduce_coalesced_", "_c10d_functional.all_reduce",
        "_c10d_functional.all_reduce_coalesced",
    ),
    "broadcast": ("c10d.broadcast_", "_c10d_functional.broadcast"),
    "send": ("c10d.send",),
    "recv": ("c10d.recv_", "c10d.recv_any_source_"),
}
_KIND_OF = {op: kind for kind, ops in _KINDS.items() for op in ops}
_DEVICE = torch.ops.prim.device.default
_PROFILER_OPS = (torch.ops.profiler._record_function_enter_new.default, torch.ops.profiler._record_function_exit.default,
                 torch.ops.profiler._record_function_exit._RecordFunction)
_IGNORED = {"_c10d_functional.wait_tensor", "c10d.barrier", "c10d.monitored_barrier_"}


@dataclass(frozen=True)
class Collective:
    """One collective as this rank issued it."""

    kind: str
    """``all_to_all``, ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``broadcast``, ``send``, ``recv``."""
    ranks: tuple[int, ...]
    """Global ranks of its process group."""
    backward: bool
    """Issued while autograd ran backward."""
    module: str | None
    """The model's top-level part it ran in: ``layers.<i>``, ``embed``, ``norm``, ``lm_head``; None outside them."""
    site: str
    """The product file that issued it (innermost ``lightning_moe`` frame), ``""`` from autograd or torch alone."""
    shape: tuple[int, ...]
    """Shape of its first tensor argument (the output buffer of the in-place ops)."""
    op: str = ""
    """The reduction of ``all_reduce`` and ``reduce_scatter``: ``sum``, ``max``, ``avg``, ...; ``""`` for the others."""
    nbytes: int = 0
    """Bytes of its first tensor argument."""
    sent_bytes: int = 0
    """Bytes this rank sends for it under ring/pairwise algorithms (`lightning_moe.planning.wire_bytes`)."""


@dataclass(frozen=True)
class HostRead:
    """One read of a device value by the host."""

    site: str
    """``file.py:function`` of the product function that read it."""
    backward: bool


@dataclass
class StepRecord:
    """What one optimizer step did on this rank."""

    collectives: list[Collective] = field(default_factory=list)
    host_reads: list[HostRead] = field(default_factory=list)
    host_tensor_reads: int = 0
    """Reads of host tensors: in ``torch.optim`` (Adam's step counters) and of real (not fake)
    tensors. No device synchronisation."""
    start_bytes: int = 0
    """Live bytes when the step began."""
    peak_bytes: int = 0
    """Largest live bytes during the step."""
    peak_dispatch_bytes: int = 0
    """Of ``peak_bytes``, the storages the token dispatchers and their collectives made
    (``parallel/dispatchers/``, ``parallel/collectives.py``): rows sent, received and regrouped."""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    """Largest live bytes per phase: ``forward``, ``backward`` (micro-batches), ``optimizer``, ``save``."""
    blocks_saved_bytes: int = 0
    """Live bytes gained from the embedding's output to the final norm's input in the first
    micro-batch's forward: what the transformer blocks keep for backward."""
    head_saved_bytes: int = 0
    """Live bytes gained from the final norm's input to the loss in the first micro-batch's
    forward: what the final norm, the head and the loss keep for backward."""

    def count(self, **match: Any) -> Counter:
        """Collectives whose fields equal ``match``, counted by ``(kind, ranks)``."""
        return Counter(
            (c.kind, c.ranks) for c in self.collectives if all(getattr(c, k) == v for k, v in match.items())
        )


def _site(frame, stop_at_optim: bool = False) -> tuple[str, bool]:
    """(``file.py:function`` of the innermost product frame, whether a ``torch.optim`` frame came first)."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_PACKAGE) and not filename.startswith(_PLANNING):
            return f"{os.path.basename(filename)}:{frame.f_code.co_name}", False
        if stop_at_optim and _OPTIM in filename:
            return f"{os.path.basename(filename)}:{frame.f_code.co_name}", True
        frame = frame.f_back
    return "", False


def _made_by_dispatcher(frame) -> bool:
    """Whether the innermost product frame (outside the planner) is a token dispatcher's."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_PACKAGE) and not filename.startswith(_PLANNING):
            return filename.startswith(_DISPATCH)
        frame = frame.f_back
    return False


def _fake_data_ptr(tensor: torch.Tensor) -> int:
    # A fake tensor's data_ptr() is 0, so GradSync (which recognises a gradient already in its
    # bucket by its address) would take every bucket's first gradient for adopted: give each
    # storage a distinct address (its StorageImpl's), offsets included.
    return storage_identity(tensor.untyped_storage()) + tensor.storage_offset() * tensor.element_size()


def _fake_storage_ptr(storage: torch.UntypedStorage) -> int:
    # A fake tensor's storage has address 0 too: code that tells storages apart by address (the expert
    # kernels' gradient workspace) would take every two for one. Its StorageImpl's address is its own.
    return storage_identity(storage)


_REDUCE_OPS = {int(getattr(dist.ReduceOp.RedOpType, name)): name.lower() for name in dist.ReduceOp.RedOpType.__members__}


def _reduce_op(kind: str, flat: list[Any]) -> str:
    """The reduction of a collective's arguments: a c10d ``ReduceOp`` object (whose ``op()`` is its
    ``RedOpType`` value) or a functional collective's name (``"sum"``, ``"max"``)."""
    if kind not in ("all_reduce", "reduce_scatter"):
        return ""
    for arg in flat:
        if "ReduceOp" in script_object_kind(arg):
            return _REDUCE_OPS[arg.op()]
        if isinstance(arg, str) and arg.lower() in _REDUCE_OPS.values():
            return arg.lower()
    raise AssertionError(f"no reduction found among the arguments of a {kind}")


def _nested(shape: tuple[int, ...], value: Any) -> Any:
    return value if not shape else [_nested(shape[1:], value) for _ in range(shape[0])]


class StepProbe(LiveBytes):
    """Collectives, host reads and live bytes of everything run inside it (module docstring).

    Args:
        answers: the value each host read returns, by reading site (``"file.py:function"``).
        tracker: the ``ModTracker`` entered alongside, for forward/backward and the current block.
    """

    def __init__(self, answers: Mapping[str, Any], tracker: ModTracker) -> None:
        super().__init__()
        self.answers, self.tracker = dict(answers), tracker
        self.record = StepRecord()
        self._dispatch: dict[int, int] = {}  # storage key -> bytes, of the storages dispatchers made
        self.live_dispatch = 0
        self._propagating = False
        self.phase = "micro-batch"
        """Set by the step driver: ``micro-batch`` (forward or backward, from the tracker), ``optimizer``
        or ``save``."""

    # -- bytes ----------------------------------------------------------------------------------

    def adopt(self, tensors: list[torch.Tensor]) -> None:
        """Count the storages of ``tensors`` (made before the probe, e.g. the parameters) as live."""
        for tensor in tensors:
            self._count(tensor)

    def _count(self, tensor: torch.Tensor) -> None:
        before = self.live
        super()._count(tensor)  # live grows here and in resized: the peaks are updated where it may have
        if self.live > before and not is_traceable_wrapper_subclass(tensor) and _made_by_dispatcher(sys._getframe(1)):
            key = storage_identity(tensor.untyped_storage())
            with self._lock:
                self._dispatch[key] = self.live - before
                self.live_dispatch += self.live - before
        self._update_peaks()

    def _release(self, key: int, nbytes: int) -> None:
        super()._release(key, nbytes)
        with self._lock:
            self.live_dispatch -= self._dispatch.pop(key, 0)

    def resized(self, tensor: torch.Tensor, before: int) -> None:
        """As `LiveBytes.resized`, and the step's peaks follow."""
        super().resized(tensor, before)
        self._update_peaks()

    def _update_peaks(self) -> None:
        if self.live > self.record.peak_bytes:
            self.record.peak_bytes, self.record.peak_dispatch_bytes = self.live, self.live_dispatch
        phase = self.phase if self.phase != "micro-batch" else ("backward" if self.tracker.is_bw else "forward")
        self.record.phase_peaks[phase] = max(self.record.phase_peaks.get(phase, 0), self.live)

    def new_step(self) -> StepRecord:
        """Start recording a new step; returns the finished one."""
        done, self.record = self.record, StepRecord(
            start_bytes=self.live, peak_bytes=self.live, peak_dispatch_bytes=self.live_dispatch
        )
        return done

    # -- host reads -----------------------------------------------------------------------------

    def _answer(self, frame) -> Any:
        site, in_optim = _site(frame, stop_at_optim=True)
        if in_optim:
            self.record.host_tensor_reads += 1
            return 1
        if site not in self.answers:
            raise AssertionError(f"unexpected host read at {site or 'a site outside lightning_moe'}")
        self.record.host_reads.append(HostRead(site, self.tracker.is_bw))
        return self.answers[site]

    def _tolist(self, tensor: torch.Tensor) -> Any:
        # One device-to-host copy on a GPU; FakeTensor.tolist would read element by element.
        return _nested(tuple(tensor.shape), self._answer(sys._getframe(1)))

    def _synchronize(self, *args: Any, **kwargs: Any) -> None:
        self._answer(sys._getframe(1))

    # -- dispatch -------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE and isinstance(args[0], FakeTensor):
            # Asked of nearly every tensor by the autograd engine (half the ops of a step): answered as
            # FakeTensorMode answers it, without a mode's per-op work.
            return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
        if func in _PROFILER_OPS:  # profiler ranges: no tensor, no memory
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if DTensor in types:
            return NotImplemented  # let DTensor desugar into local ops and collectives, then see those
        if func is host_read_op():
            if not isinstance(args[0], FakeTensor):  # a real tensor: made outside FakeTensorMode, on the host
                self.record.host_tensor_reads += 1
                return func(*args, **kwargs)
            return self._answer(sys._getframe(1))
        name = str(func.overloadpacket)
        if name in _KIND_OF:
            self._record_collective(_KIND_OF[name], name, args, kwargs)
        elif func.namespace in COLLECTIVE_NAMESPACES and name not in _IGNORED:
            raise AssertionError(f"collective {name} is not classified in lightning_moe.planning.step_probe._KINDS")
        out = func(*args, **kwargs)
        if not self._propagating:
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor):
                    self._count(tensor)
        return out

    def _record_collective(self, kind: str, name: str, args: tuple, kwargs: dict) -> None:
        group = None
        flat = tree_flatten((args, kwargs))[0]
        for arg in flat:
            if "ProcessGroup" in script_object_kind(arg):
                group = unbox_process_group(arg)
        if group is None:  # functional collectives name their group last
            group = resolve_process_group([a for a in args if isinstance(a, str)][-1])
        first = next(a for a in flat if isinstance(a, torch.Tensor))
        ranks = tuple(dist.get_process_group_ranks(group))
        if kwargs:  # torch.distributed passes them positionally; sent_bytes reads them by position
            raise AssertionError(f"collective {name} called with keyword arguments {sorted(kwargs)}")
        self.record.collectives.append(Collective(
            kind, ranks, self.tracker.is_bw, self._module(),
            _site(sys._getframe(2))[0].split(":")[0], tuple(first.shape), _reduce_op(kind, flat),
            first.numel() * first.element_size(), sent_bytes(kind, name, args, ranks, dist.get_rank()),
        ))

    def _module(self) -> str | None:
        # ModTracker names modules by their path from the root's class name: "MoETransformer.layers.0.attn".
        parts = [p.split(".")[1:] for p in self.tracker.parents if p.count(".") >= 1]
        parts = [p for p in parts if p]
        if not parts:
            return None
        top = min(parts, key=len)
        return ".".join(top[:2]) if top[0] == "layers" and len(top) > 1 else top[0]

    def _propagation(self, real: Callable) -> Callable:
        # DTensor runs a new op once on global-shape fake tensors to learn its output's shape;
        # under an outer FakeTensorMode those pass through this mode: not an allocation of a run.
        def propagate(*args: Any, **kwargs: Any) -> Any:
            previous, self._propagating = self._propagating, True
            try:
                return real(*args, **kwargs)
            finally:
                self._propagating = previous

        return propagate

    @contextmanager
    def patched(self) -> Iterator[None]:
        """Route ``FakeTensor.tolist`` and ``torch.cuda.synchronize`` through the probe, give fake
        tensors and their storages addresses (`_fake_data_ptr`, `_fake_storage_ptr`) and mark DTensor's
        shape propagation (`_propagation`)."""
        storage_ptr = torch.UntypedStorage.data_ptr
        with mock.patch.object(FakeTensor, "tolist", lambda tensor: self._tolist(tensor)), \
                mock.patch.object(FakeTensor, "data_ptr", _fake_data_ptr), \
                mock.patch.object(torch.UntypedStorage, "data_ptr", lambda s: storage_ptr(s) or _fake_storage_ptr(s)), \
                mock.patch.object(torch.cuda, "synchronize", self._synchronize), \
                patch_tensor_meta_propagation(self._propagation):
            yield
