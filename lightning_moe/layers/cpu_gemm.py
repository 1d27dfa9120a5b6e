"""Which library runs the expert kernel's fp32 GEMMs on CPU: ATen's BLAS or oneDNN.

An fp32 ``torch.mm`` on CPU calls the BLAS torch was built with (MKL in the official wheels).
PyTorch also ships oneDNN, whose JIT-compiled kernels use the widest vector units the CPU has. On
some CPUs the two differ by 2x: on an AMD EPYC with AVX-512, MKL reaches about half of oneDNN's
fp32 rate (``benchmarks/moe_layer.py``; MKL's code paths for non-Intel processors are the likely
cause). Both compute in fp32 with fp32 accumulation;
only the summation order differs, so results agree to fp32 rounding, not bit for bit.

``auto`` (the default) therefore measures, once per process, layer shape and thread count, the
expert's fc1 GEMM with both libraries and takes oneDNN only when it is clearly faster (by
:data:`ONEDNN_MIN_SPEEDUP`); close calls stay on ATen, so the choice does not flip between runs
on machines where the two are level. ``LIGHTNING_MOE_CPU_GEMM``, :func:`set_cpu_gemm_backend` or
:func:`use_cpu_gemm_backend` forces a library (and with it bit-identical reruns). Ranks of one
job must not choose differently (their results would differ in the last bits):
``lightning_moe.parallel.cpu_gemm_agreement.agree_on_cpu_gemm`` (called by ``MoEStrategy``)
measures on rank 0 and pins its choices on every rank (:func:`pin_cpu_gemm_choices`).

oneDNN compiles one kernel per problem shape and keeps a bounded cache of them (1024 by default,
shared with everything else in the process). Expert row counts change every step, so with oneDNN
the kernel pads each expert's rows with zero rows up to :func:`padded_row_count` (at most 1/8 more
rows from 64 rows up, at most 7 below), in eight sizes per power of two, which keeps the number of
shapes small enough to stay cached. Experts with fewer than :data:`ONEDNN_MIN_ROWS` rows run
through ``torch.mm`` unpadded: there oneDNN gains nothing and padding would cost the most.
``torch.backends.mkldnn.enabled = False`` turns oneDNN off here too.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import threading
import time
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

from lightning_moe.compat import onednn_linear

__all__ = [
    "BACKENDS", "ENV_VAR", "ONEDNN_MIN_ROWS", "ONEDNN_MIN_SPEEDUP", "AtenGemm", "OneDnnGemm", "cpu_gemm_backend",
    "gemm_for", "measured_cpu_gemm_choice", "onednn_available", "padded_row_count", "pin_cpu_gemm_choices",
    "prefer_onednn", "set_cpu_gemm_backend", "use_cpu_gemm_backend",
]

BACKENDS = ("auto", "aten", "onednn")
"""Accepted backend names: measure per shape, always ATen's BLAS, always oneDNN."""

ENV_VAR = "LIGHTNING_MOE_CPU_GEMM"
"""Environment variable naming the backend when :func:`set_cpu_gemm_backend` was not called."""

ONEDNN_MIN_SPEEDUP = 1.25
"""``auto`` picks oneDNN when ATen's time is at least this many times oneDNN's."""

ONEDNN_MIN_ROWS = 16
"""Experts with fewer rows run through ``torch.mm`` even with oneDNN (measured: no gain below)."""

_PROBE_MAX_FEATURES = 2048
_forced: str | None = None
_pinned: dict[tuple[int, int], str] = {}  # (in, out) -> backend, see pin_cpu_gemm_choices
_measure_lock = threading.Lock()


def _onednn_linear(a: Tensor, w: Tensor) -> Tensor:
    """``a @ w.T`` through oneDNN (a private torch op: :func:`onednn_available` checks it first)."""
    return onednn_linear(a, w)


@functools.cache
def onednn_available() -> bool:
    """True when torch has oneDNN's fp32 linear and it computes ``a @ w.T`` correctly here."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):  # plain fp32, whatever the caller runs
            gen = torch.Generator().manual_seed(0)
            # ONEDNN_MIN_ROWS rows: fewer would go to torch.mm.
            a = torch.randn(ONEDNN_MIN_ROWS, 24, generator=gen, dtype=torch.float32, device="cpu")
            b = torch.randn(ONEDNN_MIN_ROWS, 16, generator=gen, dtype=torch.float32, device="cpu")
            w = torch.randn(16, 24, generator=gen, dtype=torch.float32, device="cpu")
            tn = torch.empty(24, 16, dtype=torch.float32, device="cpu")
            OneDnnGemm.tn_into(a, b, tn)
            # The three operand layouts the expert kernel uses.
            pairs = ((OneDnnGemm.nt(a, w), a @ w.t()), (OneDnnGemm.nn(b, w), b @ w), (tn, a.t() @ b))
            return all(torch.allclose(got, want, rtol=1e-4, atol=1e-4) for got, want in pairs)
    except (RuntimeError, AttributeError, TypeError):
        return False


def set_cpu_gemm_backend(name: str | None) -> None:
    """Force the CPU fp32 GEMM library of the expert kernel: ``auto``, ``aten`` or ``onednn``.

    ``None`` returns to the environment variable :data:`ENV_VAR` (default ``auto``).

    Raises:
        ValueError: for an unknown name, or ``onednn`` where torch has no usable oneDNN.
    """
    global _forced
    _forced = None if name is None else _validate(_normalise(name), "set_cpu_gemm_backend")


@contextlib.contextmanager
def use_cpu_gemm_backend(name: str | None) -> Iterator[None]:
    """:func:`set_cpu_gemm_backend` for a ``with`` block; the previous setting is restored after it."""
    previous = _forced
    set_cpu_gemm_backend(name)
    try:
        yield
    finally:
        set_cpu_gemm_backend(previous)


def _normalise(name: str) -> str:
    return name.strip().lower() or "auto"


def cpu_gemm_backend() -> str:
    """The requested backend: the forced one, else :data:`ENV_VAR`, else ``auto``."""
    if _forced is not None:
        return _forced
    return _validate(_normalise(os.environ.get(ENV_VAR, "auto")), ENV_VAR)


def _validate(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: unknown CPU GEMM backend {name!r}; choose one of {list(BACKENDS)}.")
    if name == "onednn" and not onednn_available():
        raise ValueError(
            f"{source}: CPU GEMM backend 'onednn' requested, but this torch build has no usable oneDNN "
            "fp32 linear (torch.backends.mkldnn.is_available() is False or the op failed its check); "
            "use 'aten' or 'auto'."
        )
    return name


def prefer_onednn(aten_seconds: float, onednn_seconds: float) -> bool:
    """The ``auto`` rule: oneDNN only when ATen takes :data:`ONEDNN_MIN_SPEEDUP` times as long."""
    return aten_seconds >= ONEDNN_MIN_SPEEDUP * onednn_seconds


def _best_time(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _measured_choice(in_features: int, out_features: int) -> str:
    # One measurement at a time (two threads timing at once would skew each other), per shape
    # and thread count.
    with _measure_lock:
        return _measure(in_features, out_features, torch.get_num_threads())


@functools.cache
def _measure(in_features: int, out_features: int, threads: int) -> str:
    # The expert's fc1 GEMM on a typical expert chunk, each library warmed up, best of five; in
    # plain fp32 on the CPU whatever context the first forward runs in (autocast, a meta default
    # device, no_grad or not).
    # Dimensions capped at _PROBE_MAX_FEATURES: GEMMs that large are compute-bound in both
    # libraries alike, and the probe stays small (16 MiB at most) and quick.
    in_features, out_features = min(in_features, _PROBE_MAX_FEATURES), min(out_features, _PROBE_MAX_FEATURES)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(256, in_features, generator=gen, dtype=torch.float32, device="cpu")
        w = torch.randn(out_features, in_features, generator=gen, dtype=torch.float32, device="cpu")
        aten = lambda: torch.mm(a, w.t())  # noqa: E731
        onednn = lambda: _onednn_linear(a, w)  # noqa: E731
        for fn in (aten, onednn):
            fn()
        aten_s, onednn_s = _best_time(aten), _best_time(onednn)
    return "onednn" if prefer_onednn(aten_s, onednn_s) else "aten"


def padded_row_count(rows: int) -> int:
    """Rows the oneDNN path computes for an expert with ``rows`` rows.

    ``rows`` itself below :data:`ONEDNN_MIN_ROWS` (those run through ``torch.mm``), otherwise
    rounded up to a multiple of ``max(8, 2**floor(log2(rows)) // 8)``: at most 1/8 extra rows from
    64 rows up (at most 7 below), eight sizes per power of two, so a few dozen shapes per GEMM
    however the routing moves, and oneDNN's kernel cache keeps them all.
    """
    rows = operator.index(rows)
    if rows < ONEDNN_MIN_ROWS:
        return max(rows, 0)
    step = max(8, (1 << (rows.bit_length() - 1)) // 8)
    return -(-rows // step) * step


class AtenGemm:
    """GEMMs through ``torch.mm`` (the build's BLAS); expert rows are not padded."""

    name = "aten"

    @staticmethod
    def padded_rows(rows: int) -> int:
        """Rows the kernel computes for an expert with ``rows`` rows: exactly those."""
        return rows

    @staticmethod
    def nt(a: Tensor, w: Tensor) -> Tensor:
        """``a @ w.T``."""
        return torch.mm(a, w.t())

    @staticmethod
    def nn(a: Tensor, b: Tensor) -> Tensor:
        """``a @ b``."""
        return torch.mm(a, b)

    @staticmethod
    def tn_into(a: Tensor, b: Tensor, out: Tensor) -> None:
        """``out = a.T @ b`` (a weight gradient: the reduction runs over the rows)."""
        torch.mm(a.t(), b, out=out)


class OneDnnGemm:
    """GEMMs through oneDNN's fp32 matmul; expert rows are padded to :func:`padded_row_count`.

    Operands with fewer than :data:`ONEDNN_MIN_ROWS` rows (unpadded small experts) go to ``torch.mm``.
    """

    name = "onednn"
    padded_rows = staticmethod(padded_row_count)

    @staticmethod
    def nt(a: Tensor, w: Tensor) -> Tensor:
        """``a @ w.T``."""
        return AtenGemm.nt(a, w) if a.shape[0] < ONEDNN_MIN_ROWS else _onednn_linear(a, w)

    @staticmethod
    def nn(a: Tensor, b: Tensor) -> Tensor:
        """``a @ b``."""
        return AtenGemm.nn(a, b) if a.shape[0] < ONEDNN_MIN_ROWS else _onednn_linear(a, b.t())

    @staticmethod
    def tn_into(a: Tensor, b: Tensor, out: Tensor) -> None:
        """``out = a.T @ b`` (oneDNN's op has no ``out=``: one copy of the result)."""
        if a.shape[0] < ONEDNN_MIN_ROWS:
            AtenGemm.tn_into(a, b, out)
        else:
            out.copy_(_onednn_linear(a.t(), b.t()))


def gemm_for(device: torch.device, dtype: torch.dtype, in_features: int, out_features: int):
    """The GEMM backend for expert GEMMs of ``dtype`` on ``device`` with fc1 ``[out, in]``.

    oneDNN is only ever chosen for fp32 on CPU (half precision on CPU already goes through
    oneDNN inside ``torch.mm``; other devices have their own libraries).
    """
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.enabled:
        return AtenGemm
    name = cpu_gemm_backend()
    if name == "auto":
        name = _pinned.get((in_features, out_features)) or measured_cpu_gemm_choice(in_features, out_features)
    return OneDnnGemm if name == "onednn" else AtenGemm


def measured_cpu_gemm_choice(in_features: int, out_features: int) -> str:
    """What ``auto`` picks here for an fp32 fc1 ``[out_features, in_features]`` by measurement.

    Measured once per process, shape and thread count (the result is cached); ``aten`` where
    torch has no usable oneDNN. :func:`pin_cpu_gemm_choices` overrides it.
    """
    return _measured_choice(in_features, out_features) if onednn_available() else "aten"


def pin_cpu_gemm_choices(choices: Mapping[tuple[int, int], str] | None) -> None:
    """Make ``auto`` use ``choices[(in_features, out_features)]`` instead of measuring; None clears.

    For processes that must compute alike: a multi-process run measures on one rank and pins
    that rank's choices everywhere (``lightning_moe.parallel.cpu_gemm_agreement.agree_on_cpu_gemm``),
    since each process would otherwise measure for itself and the ranks could sum in different orders.
    Shapes missing from ``choices`` are still measured. A forced backend (:func:`set_cpu_gemm_backend`
    or :data:`ENV_VAR`) takes precedence.
    """
    _pinned.clear()
    for shape, name in (choices or {}).items():
        _pinned[tuple(shape)] = _validate(_normalise(name), "pin_cpu_gemm_choices")
