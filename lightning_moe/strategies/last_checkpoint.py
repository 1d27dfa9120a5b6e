"""``ckpt_path="last"`` under `MoEStrategy`: the newest *complete* checkpoint of the run.

Lightning resolves ``"last"`` to the newest ``last*.ckpt`` in each ``ModelCheckpoint``'s folder
(``ModelCheckpoint._find_last_checkpoints``). When the first save of ``last.ckpt`` was cut (a
crash, a full disk), only the hidden partial sibling of that save exists
(:mod:`lightning_moe.checkpoint.files`), Lightning finds nothing, warns, and training
restarts from step 0 beside complete top-k checkpoints; the restarted run then saves the same
names again, as ``-v1`` duplicates.

:func:`install` wraps that method once (at import of :mod:`lightning_moe.strategies`), for
trainers whose strategy is a `MoEStrategy` only: ``last*.ckpt`` candidates that are complete are
kept; when there is none, the newest complete checkpoint of the folder (a ``*.ckpt`` file, or a
``*.ckpt`` folder holding ``meta.pt``: saves are renamed into place only once complete; hidden
names are never taken) is used instead, with a warning that names it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_moe.checkpoint.integrity import META_FILE

__all__ = ["complete_checkpoints", "install"]

_MARK = "_lightning_moe_last_fallback"


def _is_complete(path: Path) -> bool:
    return path.is_file() or (path / META_FILE).is_file()


def complete_checkpoints(directory: Path) -> list[Path]:
    """The complete ``*.ckpt`` checkpoints in ``directory`` (none hidden), oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.suffix == ".ckpt" and not p.name.startswith(".") and _is_complete(p)]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def _local_dir(callback: ModelCheckpoint, trainer: Any) -> Path | None:
    resolve = getattr(callback, "_ModelCheckpoint__resolve_ckpt_dir", None)  # what Lightning's own lookup uses
    if resolve is None:
        return None
    directory = str(resolve(trainer))
    return Path(directory) if "://" not in directory or directory.startswith("file://") else None


def install() -> None:
    """Wrap ``ModelCheckpoint._find_last_checkpoints`` (once) with the fallback of the module docstring."""
    original = ModelCheckpoint._find_last_checkpoints
    if getattr(original, _MARK, False):
        return

    def find_last_checkpoints(self: ModelCheckpoint, trainer: Any) -> set[str]:
        found = original(self, trainer)
        from lightning_moe.strategies.moe_strategy import MoEStrategy  # the strategy module imports this one

        if not isinstance(getattr(trainer, "strategy", None), MoEStrategy):
            return found
        complete = {p for p in found if _is_complete(Path(p))}
        if complete:
            return complete
        directory = _local_dir(self, trainer)
        candidates = complete_checkpoints(directory) if directory is not None else []
        if not candidates:
            return found
        newest = candidates[-1]
        cut = sorted(p.name for p in directory.iterdir() if p.name.startswith(f".{self.CHECKPOINT_NAME_LAST}"))
        why = f" (interrupted saves: {', '.join(cut)})" if cut else ""
        rank_zero_warn(
            f'ckpt_path="last": no complete last checkpoint in {directory}{why}; resuming from the newest '
            f"complete checkpoint of the run, {newest}."
        )
        return {os.path.normpath(str(newest))}

    setattr(find_last_checkpoints, _MARK, True)
    ModelCheckpoint._find_last_checkpoints = find_last_checkpoints
