"""`CUDAGraphCapture`: per-layer partial CUDA graphs as a Trainer callback.

A thin wrapper over :class:`lightning_moe.graphs.CUDAGraphManager`::

    Trainer(accelerator="gpu", callbacks=[CUDAGraphCapture(scopes=["attn", "moe_router"], warmup_steps=3)])

Timeline of a fit: the first ``warmup_steps`` training batches run eagerly (allocator, cuBLAS
and autotuning settle); the last of them also records every stage (signature and order); right
after its backward the graphs are captured, and from the next batch on every stage replays.
``warmup_steps`` counts training batches (micro-batches under gradient accumulation), so the
capture happens in the middle of an accumulation window without harm. Validation, prediction and
any batch of another shape run eagerly (counted per stage in :meth:`CUDAGraphCapture.stats`).
The graphs are released, and the modules' own ``forward`` restored, at the end of ``fit``.

Device policy: the scope rules (:mod:`lightning_moe.graphs.scopes`) are checked against the real
model at the start of every fit on every device, so an impossible configuration fails on a CPU
dry run too (``ValueError`` naming scope and reason). Graphs themselves need CUDA: on any other
device the callback warns once and leaves the model eager (the run continues), or raises
``RuntimeError`` with ``strict=True``. ``emulate=True`` runs the capture/replay plumbing without
CUDA graphs (for tests and debugging: no speed-up).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_moe.graphs import CUDAGraphManager, find_targets, validate_scopes

__all__ = ["CUDAGraphCapture"]


class CUDAGraphCapture(Callback):
    """Capture CUDA graphs of parts of every layer after ``warmup_steps`` eager batches.

    Args:
        scopes: any of ``attn``, ``moe_router``, ``moe_preprocess``, ``moe`` (see
            :mod:`lightning_moe.graphs.scopes` for what each captures and when it is legal).
        warmup_steps: eager training batches before capture (>= 1; the last one is recorded).
        num_warmup_iters: extra forward+backward runs of each stage on a side stream right before
            capture.
        strict: raise instead of warning when the training device is not a CUDA GPU.
        emulate: run the plumbing without CUDA graphs on any device (tests, debugging).
    """

    def __init__(
        self,
        scopes: Sequence[str] = ("attn", "moe_router"),
        warmup_steps: int = 3,
        num_warmup_iters: int = 2,
        strict: bool = False,
        emulate: bool = False,
    ) -> None:
        self.scopes = validate_scopes(scopes)
        if warmup_steps < 1:
            raise ValueError(
                f"warmup_steps must be >= 1 (the last warm-up batch records the stages), got {warmup_steps}."
            )
        if num_warmup_iters < 0:
            raise ValueError(f"num_warmup_iters must be >= 0, got {num_warmup_iters}.")
        self.warmup_steps = warmup_steps
        self.num_warmup_iters = num_warmup_iters
        self.strict = strict
        self.emulate = emulate
        self.manager: CUDAGraphManager | None = None
        self._batches = 0
        self._last_stats: dict[str, dict[str, int]] = {}

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Check the scope rules on the model, then stage it (CUDA, or ``emulate``)."""
        find_targets(pl_module, self.scopes)
        device = trainer.strategy.root_device
        if device.type != "cuda" and not self.emulate:
            message = (
                f"CUDAGraphCapture(scopes={list(self.scopes)}) needs a CUDA device but training runs on "
                f"{device}; the model runs eagerly."
            )
            if self.strict:
                raise RuntimeError(message + " Pass strict=False to continue without graphs.")
            rank_zero_warn(message)
            return
        self._batches = 0
        self.manager = CUDAGraphManager(
            pl_module,
            self.scopes,
            num_warmup_iters=self.num_warmup_iters,
            backend="emulate" if self.emulate else "cuda",
        )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        """Start recording on the last warm-up batch."""
        manager = self.manager
        if manager is not None and not manager.captured and self._batches == self.warmup_steps - 1:
            manager.start_recording()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        """Capture right after the recorded batch's backward."""
        self._batches += 1
        if self.manager is not None and self.manager.recording:
            self.manager.capture()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Release the graphs and restore the modules' forwards."""
        self._release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release()

    def _release(self) -> None:
        if self.manager is not None:
            self._last_stats = self.manager.stats()
            self.manager.release()
            self.manager = None

    def stats(self) -> dict[str, dict[str, int]]:
        """Replays, eager calls and eager fallbacks of every stage (of the last fit once it ended)."""
        return self._last_stats if self.manager is None else self.manager.stats()
