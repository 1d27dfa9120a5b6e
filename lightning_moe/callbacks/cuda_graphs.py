"""`CUDAGraphCapture`: per-layer partial CUDA graphs as a Trainer callback.

A thin wrapper over :class:`lightning_moe.graphs.CUDAGraphManager`::

    Trainer(accelerator="gpu", callbacks=[CUDAGraphCapture(scopes=["attn", "moe_router"], warmup_steps=3)])

Timeline of a fit: the first ``warmup_steps`` training batches run eagerly (allocator, cuBLAS
and autotuning settle); the last of them also records every stage (signature and order); right
after its backward the graphs are captured, and from the next batch on every stage replays.
``warmup_steps`` counts training batches (micro-batches under gradient accumulation), so the
capture happens in the middle of an accumulation window without harm. Validation, prediction and
any batch of another shape run eagerly (counted per stage in :meth:`CUDAGraphCapture.stats`).
The graphs are released, and the modules' own methods restored, at the end of ``fit``.

Any model: ``attn`` captures the attention of the blocks a model declares
(``parallel_plan().graph_blocks``, :mod:`lightning_moe.parallel.model_plan`; the reference model's
``TransformerBlock`` s), the MoE scopes every ``lightning_moe.MoELayer`` (bare MoE layers in a
user's own model included). A scope that finds nothing in the model (``attn`` on a model that
declares no blocks) warns once,
naming the scope and what it looks for, and is skipped; the others still capture. With
``strict=True`` it raises ``ValueError`` instead.

Device policy: the scope rules (:mod:`lightning_moe.graphs.scopes`) are checked against the real
model at the start of every fit on every device, so an impossible configuration fails on a CPU
dry run too (``ValueError`` naming scope and reason). Graphs themselves need CUDA: on any other
device the callback warns once (rank 0) that it does nothing and leaves the model eager (the run
continues), or raises ``RuntimeError`` with ``strict=True``. ``emulate=True`` runs the
capture/replay plumbing without CUDA graphs (for tests and debugging: no speed-up).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import WarningCache

from lightning_moe.graphs import CUDAGraphManager, find_targets, missing_scopes, validate_scopes

__all__ = ["CUDAGraphCapture"]


class CUDAGraphCapture(Callback):
    """Capture CUDA graphs of parts of every layer after ``warmup_steps`` eager batches.

    Args:
        scopes: any of ``attn``, ``moe_router``, ``moe_preprocess``, ``moe`` (see
            :mod:`lightning_moe.graphs.scopes` for what each captures and when it is legal).
        warmup_steps: eager training batches before capture (>= 1; the last one is recorded).
        num_warmup_iters: extra forward+backward runs of each stage on a side stream right before
            capture.
        strict: raise instead of warning when a scope finds nothing in the model (``ValueError``)
            or the training device is not a CUDA GPU (``RuntimeError``).
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
        self._warnings = WarningCache()  # each message once per callback
        self._batches = 0
        self._last_stats: dict[str, dict[str, int]] = {}

    def _scopes_found(self, pl_module: LightningModule) -> tuple[str, ...]:
        """The scopes that find something in ``pl_module``; the others warn once (or raise when strict)."""
        missing = missing_scopes(pl_module, self.scopes)
        kept = tuple(scope for scope in self.scopes if scope not in missing)
        for scope, looks_for in missing.items():
            message = (
                f"CUDAGraphCapture: scope {scope!r} found nothing to capture in {type(pl_module).__name__}: "
                f"{looks_for}."
            )
            if self.strict:
                raise ValueError(f"{message} Drop {scope!r} from the scopes (raised because strict=True).")
            left = f"kept scopes: {list(kept)}" if kept else "no scope is left, the model runs eagerly"
            self._warnings.warn(f"{message} The scope is skipped; {left}.")
        return kept

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Check the scope rules on the model, then stage it (CUDA, or ``emulate``)."""
        scopes = self._scopes_found(pl_module)
        if not scopes:
            return
        find_targets(pl_module, scopes)
        device = trainer.strategy.root_device
        if device.type != "cuda" and not self.emulate:
            message = (
                f"CUDAGraphCapture(scopes={list(scopes)}) does nothing on {device}: it needs a CUDA device but "
                f"training runs on {device}; the model runs eagerly."
            )
            if self.strict:
                raise RuntimeError(message + " Pass strict=False to continue without graphs.")
            self._warnings.warn(message)
            return
        self._batches = 0
        self.manager = CUDAGraphManager(
            pl_module,
            scopes,
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
