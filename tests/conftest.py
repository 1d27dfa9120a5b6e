"""Suite-wide pytest setup: hardware-dependent skips and per-test RNG / global-state hygiene."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest
import torch

# Make the shared test utilities importable as ``helpers`` from every test directory, whatever
# pytest's --import-mode (the default "prepend" mode does this already; "importlib" does not).
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

# The expert kernel's CPU GEMM library is measured per process by default ("auto"); tests fix it
# so that runs compare bit for bit across processes and exact byte counts hold on any machine.
# The oneDNN path is tested explicitly (tests/layers/test_cpu_gemm.py, test_experts.py);
# LIGHTNING_MOE_CPU_GEMM=onednn runs the rest of the suite through it too (except the tests that
# pin a library themselves: exact byte counts, the choice itself, the benchmark smoke tests).
os.environ.setdefault("LIGHTNING_MOE_CPU_GEMM", "aten")

# One intra-op thread in the pytest process, as every forked rank has (helpers.dist): the tests'
# tensors are tiny, and on a machine of few cores that are shared (the suite's own forked ranks and
# subprocesses, other jobs) each parallel region waits for a second thread the OS has not
# scheduled yet, which made single-process tests several times slower than with one thread.
# Subprocesses (the CLI, examples, benchmarks) keep their own defaults: OMP_NUM_THREADS is not set.
# LIGHTNING_MOE_TEST_THREADS=0 keeps torch's default here too.
_TEST_THREADS = int(os.environ.get("LIGHTNING_MOE_TEST_THREADS", "1"))
if _TEST_THREADS > 0:
    torch.set_num_threads(_TEST_THREADS)

# Transformer Engine's FP8 kernels need Ada (sm_89) or newer.
_MIN_FP8_CAPABILITY = (8, 9)


@functools.cache
def _gpu_skip_reason() -> str | None:
    if torch.cuda.is_available():
        return None
    return "needs a CUDA GPU (torch.cuda.is_available() is False)"


@functools.cache
def _te_skip_reason() -> str | None:
    # Only evaluated when a `te` test was collected: importing Transformer Engine is slow.
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # ImportError, or a broken install failing to load its libraries
        return f"needs Transformer Engine (pip install -e '.[te]'): {type(err).__name__}: {err}"
    if not torch.cuda.is_available():
        return "needs an FP8-capable CUDA GPU; none is available"
    capabilities = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    if not any(cap >= _MIN_FP8_CAPABILITY for cap in capabilities):
        return f"needs a GPU with compute capability >= {_MIN_FP8_CAPABILITY}; found {capabilities}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Turn tests marked ``gpu`` / ``te`` into skips (with the reason) where the hardware is missing."""
    for item in items:
        for marker, reason_fn in (("gpu", _gpu_skip_reason), ("te", _te_skip_reason)):
            if item.get_closest_marker(marker) is not None and (reason := reason_fn()) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _torch_global_state():
    """Seed torch's RNG for every test and undo changes a test made to torch's global defaults."""
    torch.manual_seed(0)
    dtype, num_threads = torch.get_default_dtype(), torch.get_num_threads()
    yield
    if torch.get_default_dtype() != dtype:
        torch.set_default_dtype(dtype)
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


@pytest.fixture
def aten_gemms():
    """Pins the expert kernel to ``torch.mm`` GEMMs: exact saved-byte counts assume unpadded expert rows
    (with oneDNN each expert's fc1 output and activation are padded, see ``layers.cpu_gemm``)."""
    from lightning_moe.layers.cpu_gemm import set_cpu_gemm_backend

    set_cpu_gemm_backend("aten")
    yield
    set_cpu_gemm_backend(None)
