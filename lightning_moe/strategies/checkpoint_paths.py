"""Checkpoint paths that come back from a checkpoint are held to the callbacks' own folders.

``ModelCheckpoint`` restores ``best_model_path``, ``last_model_path``, ``kth_best_model_path`` and
the keys of ``best_k_models`` from ``meta.pt`` and later deletes the ones it replaces through
:meth:`MoEStrategy.remove_checkpoint`. Its own guard (``dirpath in previous.parents``) compares the
paths as written, so ``<dirpath>/../victim`` passes it. Two checks close that:

* :func:`drop_outside_paths` (on load): a restored path that does not resolve to an entry directly
  in its state's resolved ``dirpath`` (or whose state has no ``dirpath``) is dropped, with a
  warning: Lightning then neither reports nor deletes it;
* :func:`checkpoint_dirpaths` gives ``MoECheckpointing.remove`` the live callbacks' folders, and it
  refuses (with a warning) any path that does not resolve into one of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_moe.compat import is_local_path

__all__ = ["checkpoint_dirpaths", "drop_outside_paths"]

_PATH_KEYS = ("best_model_path", "last_model_path", "kth_best_model_path")
"""``ModelCheckpoint.state_dict()`` entries holding one checkpoint path (``best_k_models`` holds several)."""


def checkpoint_dirpaths(strategy: Any) -> list[Path] | None:
    """The local ``dirpath`` of every ``ModelCheckpoint`` of ``strategy``'s trainer, or None without a trainer."""
    module = getattr(strategy, "_lightning_module", None)
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return None
    return [
        Path(cb.dirpath) for cb in trainer.checkpoint_callbacks
        if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None and is_local_path(str(cb.dirpath))
    ]


def _inside(path: Any, dirpath: Path | None) -> bool:
    if not isinstance(path, str) or not path:
        return not path  # "" and None are how ModelCheckpoint says "none yet"
    if dirpath is None or not is_local_path(path):
        return False
    candidate = Path(path)
    if candidate.name in ("", ".", ".."):
        return False
    return candidate.parent.resolve() == dirpath


def drop_outside_paths(meta: dict[str, Any], source: Path) -> None:
    """Drop, in the callback states of Lightning's checkpoint dict ``meta`` (read from ``source``),
    every checkpoint path that is not directly inside its state's ``dirpath``; warn naming them."""
    callbacks = meta.get("callbacks") if isinstance(meta, dict) else None
    if not isinstance(callbacks, dict):
        return
    for name, state in callbacks.items():
        if not isinstance(state, dict) or not ({"best_k_models", *_PATH_KEYS} & state.keys()):
            continue
        raw = state.get("dirpath")
        dirpath = Path(raw).resolve() if isinstance(raw, str) and raw and is_local_path(raw) else None
        dropped = [state[key] for key in _PATH_KEYS if key in state and not _inside(state[key], dirpath)]
        for key in _PATH_KEYS:
            if key in state and not _inside(state[key], dirpath):
                state[key] = ""
        best = state.get("best_k_models")
        if isinstance(best, dict):
            dropped += [p for p in best if not _inside(p, dirpath)]
            state["best_k_models"] = {p: v for p, v in best.items() if _inside(p, dirpath)}
        elif best is not None:
            dropped.append(best)
            state["best_k_models"] = {}
        if dropped:
            rank_zero_warn(
                f"{source}: the state of {name} names checkpoints outside its folder {raw!r}: "
                f"{', '.join(repr(str(p)) for p in dropped[:5])}. Dropped: they are not reported and never deleted."
            )
