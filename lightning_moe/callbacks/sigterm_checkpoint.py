"""`CheckpointOnSigterm`: save a resumable checkpoint when the job is told to stop (SLURM's SIGTERM).

Schedulers send SIGTERM some time before they kill a job (SLURM: at the time limit or on
preemption; ``--signal=TERM@120`` makes it two minutes early). A sharded checkpoint must be
written by every rank together, but the signal reaches the ranks at different moments (or only
some of them), and Lightning acts on it where each rank happens to be. So this callback takes the
signal over while training: its handler only records it, and at the end of every training batch
the ranks agree on one flag (the strategy's ``reduce_boolean_decision``: one all-reduce of one
number over the ranks, nothing at all on one device). The first batch end at which any
rank has it, every rank saves the checkpoint there, together, and then stops with
``SIGTERMException`` (exit code 143 = 128 + SIGTERM, so the scheduler and wrapper scripts see
that the run did not finish). A signal during validation takes effect at the next training batch.

The checkpoint goes to ``last.ckpt`` in the ``ModelCheckpoint`` directory, where
``--ckpt_path last`` resumes from, or to ``dirpath``/``filename`` when given.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

__all__ = ["CheckpointOnSigterm"]

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


class CheckpointOnSigterm(Callback):
    """Save a checkpoint when training is stopped by SIGTERM, for ``--ckpt_path last`` to resume from.

    Args:
        dirpath: where to save; default: the ``ModelCheckpoint`` callback's directory, else
            ``<default_root_dir>/checkpoints``.
        filename: the checkpoint's name without the ``.ckpt`` suffix; default ``last``, the name
            Lightning's ``ckpt_path="last"`` looks for.
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str = "last") -> None:
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.filename = filename
        self._requested = False
        self._previous_handler: Any = None

    def checkpoint_path(self, trainer: Trainer) -> Path:
        """Where the checkpoint of ``trainer`` goes."""
        directory = self.dirpath
        if directory is None:
            callback_dir = getattr(trainer.checkpoint_callback, "dirpath", None)
            directory = Path(callback_dir) if callback_dir else Path(trainer.default_root_dir) / "checkpoints"
        return directory / f"{self.filename}.ckpt"

    def _record(self, signum, frame) -> None:
        self._requested = True

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Take SIGTERM over from Lightning for the training loop (signals reach the main thread only)."""
        self._requested = False
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._record)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        """Agree across ranks whether any got SIGTERM; if so, save together and stop."""
        # Any rank (all=False); Lightning's own per-batch check broadcasts rank 0's signal only.
        if not trainer.strategy.reduce_boolean_decision(self._requested, all=False):
            return
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        rank_zero_info(f"CheckpointOnSigterm: SIGTERM received; saved {path} at step {trainer.global_step}; stopping.")
        raise SIGTERMException(SIGTERM_EXIT_CODE)

    def _restore_handler(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Give SIGTERM back to whoever had it."""
        self._restore_handler()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Give SIGTERM back (training ended with an error or by this callback's stop)."""
        self._restore_handler()
