"""Which library runs the expert kernel's fp32 GEMMs on CPU: ATen's BLAS or oneDNN.

An fp32 ``torch.mm`` on CPU calls the BLAS torch was built with (MKL in the official wheels).
PyTorch also ships oneDNN, whose JIT-compiled kernels use the widest vector units the CPU has. On
some CPUs the two differ by 2x: MKL runs its AVX2 code on AMD processors with AVX-512, oneDNN
runs AVX-512 there (``benchmarks/moe_layer.py``). Both compute in fp32 with fp32 accumulation;
only the summation order differs, so results agree to fp32 rounding, not bit for bit.

``auto`` (the default) therefore measures, once per process and layer shape, the expert's fc1
GEMM with both libraries and takes oneDNN only when it is clearly faster (by
:data:`ONEDNN_MIN_SPEEDUP`); close calls stay on ATen, so the choice does not flip between runs
on machines where the two are level. ``LIGHTNING_MOE_CPU_GEMM`` or :func:`set_cpu_gemm_backend`
forces a library.

oneDNN compiles one kernel per problem shape and keeps a bounded cache of them (1024 by default,
shared with everything else in the process). Expert row counts change every step, so with oneDNN
the kernel pads each expert's rows up to :func:`padded_row_count` (at most 1/8 more rows from 128
rows up, a multiple of 16 below) in eight sizes per power of two, which keeps the number of shapes
small enough to stay cached.
"""

from __future__ import annotations

import functools
import os
import time

import torch
from torch import Tensor

__all__ = [
    "BACKENDS", "ENV_VAR", "ONEDNN_MIN_SPEEDUP", "AtenGemm", "OneDnnGemm", "cpu_gemm_backend", "gemm_for",
    "onednn_available", "padded_row_count", "prefer_onednn", "set_cpu_gemm_backend",
]

BACKENDS = ("auto", "aten", "onednn")
"""Accepted backend names: measure per shape, always ATen's BLAS, always oneDNN."""

ENV_VAR = "LIGHTNING_MOE_CPU_GEMM"
"""Environment variable naming the backend when :func:`set_cpu_gemm_backend` was not called."""

ONEDNN_MIN_SPEEDUP = 1.25
"""``auto`` picks oneDNN when ATen's time is at least this many times oneDNN's."""

_forced: str | None = None


def _onednn_linear(a: Tensor, w: Tensor) -> Tensor:
    """``a @ w.T`` through oneDNN (a private torch op: :func:`onednn_available` checks it first)."""
    return torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")


@functools.cache
def onednn_available() -> bool:
    """True when torch has oneDNN's fp32 linear and it computes ``a @ w.T`` correctly here."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):  # plain fp32, whatever the caller runs
            gen = torch.Generator().manual_seed(0)
            a = torch.randn(5, 24, generator=gen, dtype=torch.float32, device="cpu")
            b = torch.randn(5, 16, generator=gen, dtype=torch.float32, device="cpu")
            w = torch.randn(16, 24, generator=gen, dtype=torch.float32, device="cpu")
            tn = torch.empty(24, 16, device="cpu")
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
    if name is not None:
        _validate(name, "set_cpu_gemm_backend")
    _forced = name


def cpu_gemm_backend() -> str:
    """The requested backend: the forced one, else :data:`ENV_VAR`, else ``auto``."""
    if _forced is not None:
        return _forced
    name = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    return _validate(name, ENV_VAR)


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


@functools.cache
def _measured_choice(in_features: int, out_features: int) -> str:
    # The expert's fc1 GEMM on a typical expert chunk, each library warmed up, best of five; in
    # plain fp32 on the CPU whatever context the first forward runs in (autocast, a meta default
    # device, no_grad or not).
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
    """``rows`` rounded up to a multiple of ``max(16, 2**floor(log2(rows)) // 8)``.

    At most 1/8 extra rows (16 below 128 rows), and eight sizes per power of two: a few dozen
    distinct shapes per GEMM however the routing moves, so oneDNN's kernel cache keeps them all.
    """
    if rows <= 0:
        return 0
    step = max(16, (1 << (rows.bit_length() - 1)) // 8)
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
    """GEMMs through oneDNN's fp32 matmul; expert rows are padded to :func:`padded_row_count`."""

    name = "onednn"
    padded_rows = staticmethod(padded_row_count)

    @staticmethod
    def nt(a: Tensor, w: Tensor) -> Tensor:
        """``a @ w.T``."""
        return _onednn_linear(a, w)

    @staticmethod
    def nn(a: Tensor, b: Tensor) -> Tensor:
        """``a @ b``."""
        return _onednn_linear(a, b.t())

    @staticmethod
    def tn_into(a: Tensor, b: Tensor, out: Tensor) -> None:
        """``out = a.T @ b`` (oneDNN's op has no ``out=``: one copy of the result)."""
        out.copy_(_onednn_linear(a.t(), b.t()))


def gemm_for(device: torch.device, dtype: torch.dtype, in_features: int, out_features: int):
    """The GEMM backend for expert GEMMs of ``dtype`` on ``device`` with fc1 ``[out, in]``.

    oneDNN is only ever chosen for fp32 on CPU (half precision on CPU already goes through
    oneDNN inside ``torch.mm``; other devices have their own libraries).
    """
    if device.type != "cpu" or dtype != torch.float32:
        return AtenGemm
    name = cpu_gemm_backend()
    if name == "auto":
        name = _measured_choice(in_features, out_features) if onednn_available() else "aten"
    return OneDnnGemm if name == "onednn" else AtenGemm
