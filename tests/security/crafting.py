"""Crafting a checkpoint as an attacker would: edits that keep its records self-consistent.

Imported as ``from security.crafting import ...`` by the tests of this folder. A crafted
checkpoint whose digests no longer match would be refused by the digest check alone; these helpers
rewrite the records after each edit (``.metadata``'s record in ``meta.pt``, ``meta.pt``'s in
``meta.pt.json`` when there is one), so each test reaches the check it is about.
:func:`snapshot` is the oracle of "nothing outside the checkpoint changed".
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

__all__ = ["read_meta", "read_metadata", "snapshot", "write_meta", "write_metadata"]


def read_meta(ckpt: Path) -> dict:
    """``meta.pt`` of a checkpoint the test wrote (trusted)."""
    return torch.load(ckpt / "meta.pt", weights_only=True)


def read_metadata(ckpt: Path) -> Any:
    """``.metadata`` of a checkpoint the test wrote (trusted)."""
    with open(ckpt / ".metadata", "rb") as file:
        return pickle.load(file)


def _record(path: Path) -> dict:
    data = path.read_bytes()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_meta(ckpt: Path, meta: dict) -> None:
    """Replace ``meta.pt`` and, if the checkpoint has one, its record."""
    torch.save(meta, ckpt / "meta.pt")
    if (ckpt / "meta.pt.json").exists():
        (ckpt / "meta.pt.json").write_text(json.dumps(_record(ckpt / "meta.pt")))


def write_metadata(ckpt: Path, metadata: Any = None, payload: bytes | None = None) -> None:
    """Replace ``.metadata`` (a pickled ``metadata`` or raw ``payload``) and rewrite its record."""
    data = payload if payload is not None else pickle.dumps(metadata)
    (ckpt / ".metadata").write_bytes(data)
    meta = read_meta(ckpt)
    files = meta["lightning_moe"].get("files")
    if files is not None:
        files[".metadata"] = _record(ckpt / ".metadata")
    write_meta(ckpt, meta)


def snapshot(root: Path, skip: Path | None = None) -> dict[str, tuple[int, int, bool]]:
    """``{path: (size, mtime_ns, is_link)}`` of everything under ``root`` except under ``skip``."""
    out = {}
    skipped = skip.resolve() if skip is not None else None
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            if skipped is not None and path.resolve().is_relative_to(skipped):
                continue
            info = path.lstat()
            out[str(path)] = (info.st_size, info.st_mtime_ns, path.is_symlink())
    return out
