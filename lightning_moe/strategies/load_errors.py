"""A checkpoint load that runs out of memory says which checkpoint asked for it.

The loaders check what they can before allocating (declared sizes against the files, see
:mod:`lightning_moe.checkpoint.security`), but an allocation can still fail: a checkpoint
whose sizes fit the files but not this machine, or a rank with too little memory for the model
and its optimizer states. The allocator's own message ("DefaultCPUAllocator: not enough memory:
you tried to allocate 85899345920 bytes", "CUDA out of memory") names no file;
:func:`describe_allocation_failure` turns it into a ``MemoryError`` that names the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["describe_allocation_failure", "is_allocation_failure"]

_ALLOCATION_FAILURES = ("can't allocate memory", "not enough memory", "out of memory", "failed to allocate")


def is_allocation_failure(err: BaseException) -> bool:
    """True for a ``MemoryError`` and for torch's allocator errors (CPU or CUDA)."""
    return isinstance(err, MemoryError) or any(text in str(err).lower() for text in _ALLOCATION_FAILURES)


def describe_allocation_failure(path: Path, err: BaseException) -> MemoryError | None:
    """A ``MemoryError`` naming ``path`` and the fix when loading it failed to allocate memory, else None."""
    if not is_allocation_failure(err):
        return None
    return MemoryError(
        f"Loading the checkpoint {path} needs more memory than this rank can allocate ({type(err).__name__}: "
        f"{str(err).strip()[:300]}). Either its declared sizes do not fit this model (a damaged or foreign "
        "checkpoint: check it with `lightning-moe export`), or this rank has too little memory for the "
        "model and its optimizer states."
    )
