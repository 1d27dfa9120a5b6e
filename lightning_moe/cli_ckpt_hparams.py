"""The hyperparameters of a ``--ckpt_path`` file, as plain values the CLI may merge into its configuration.

LightningCLI merges a checkpoint file's ``hyper_parameters`` into the ``model:`` configuration, so
a file from someone else could name classes for jsonargparse to build (a ``class_path`` mapping,
or the ``_class_path`` LightningCLI records). Checkpoints are data, never code: this module
refuses any mapping key that names something to build, and any value that is not a plain
number, string, boolean, ``None``, list or mapping of those, naming the file and the key. The
class built is always the configuration's; a ``_class_path`` naming another one is refused (the
checkpoint's value is compared as text: nothing it names is imported).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lightning_moe.checkpoint.security import is_mappable
from lightning_moe.parallel.config_error import ConfigError

__all__ = ["BUILD_KEYS", "checkpoint_hyperparameters"]

BUILD_KEYS = frozenset({"class_path", "init_args", "dict_kwargs", "__class__", "__path__", "_target_"})
"""Mapping keys that ask a configuration parser to build an object or import something."""
_PLAIN = (bool, int, float, str, type(None))


def _refuse(path: str | os.PathLike, key: str, what: str) -> ConfigError:
    return ConfigError(
        f"{path}: hyper_parameters{'.' + key if key else ''} {what}; a checkpoint's hyperparameters may hold plain values only "
        "(numbers, strings, booleans, null, lists and mappings of those), refusing to merge them. "
        "If you trust the file, give the model's configuration with --config or --model.* instead."
    )


def _check_plain(path: str | os.PathLike, value: Any, key: str) -> None:
    if isinstance(value, dict):
        for name, item in value.items():
            where = f"{key}.{name}" if key else str(name)
            if not isinstance(name, str):
                raise _refuse(path, where, f"has a key of type {type(name).__name__}")
            if name in BUILD_KEYS:
                raise _refuse(path, where, "names an object to build")
            _check_plain(path, item, where)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(path, item, f"{key}[{index}]")
    elif not isinstance(value, _PLAIN):
        raise _refuse(path, key, f"is a {type(value).__name__}")


def checkpoint_hyperparameters(path: str | os.PathLike, class_names: set[str]) -> dict[str, Any]:
    """The ``hyper_parameters`` of the checkpoint file ``path`` (read with ``weights_only=True``),
    checked to be plain values; ``{}`` when it has none.

    ``class_names`` are the names of the configured model class: a ``_class_path`` the file
    records must be one of them (it is dropped, the configuration decides what is built). Raises
    :class:`~lightning_moe.parallel.config_error.ConfigError` naming the file and the key otherwise.
    """
    # Mapped, not read: every rank parses the command line, and the weights are not needed here.
    checkpoint = torch.load(Path(path), weights_only=True, map_location="cpu", mmap=is_mappable(path))
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None
    if not hparams:
        return {}
    if not isinstance(hparams, dict):
        raise _refuse(path, "", f"is a {type(hparams).__name__}, not a mapping")
    hparams = dict(hparams)
    hparams.pop("_instantiator", None)  # LightningCLI's own record of how it built the model
    recorded = hparams.pop("_class_path", None)
    if recorded is not None and recorded not in class_names:
        raise _refuse(
            path, "_class_path",
            f"= {recorded!r} names a class other than the configured model ({', '.join(sorted(class_names))})",
        )
    _check_plain(path, hparams, "")
    return hparams
