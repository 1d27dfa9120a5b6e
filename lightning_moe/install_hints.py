"""How to install an optional dependency, in the words every message about it uses.

The package is installed from a clone of its repository (it is not published on a package index),
so an extra is ``pip install -e ".[extra]"`` run in that clone; the packages the extra brings can
also be installed by name. One function, so every hint stays true when this changes.
"""

from __future__ import annotations

__all__ = ["EXTRAS", "install_hint"]

EXTRAS = {
    "hf": "safetensors tokenizers",
    "plot": "matplotlib",
    "te": '"transformer-engine[pytorch]"',
    "bench": "transformers megatron-core",
}
"""Each optional extra of ``pyproject.toml`` and the packages to install by name instead."""


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` (a key of :data:`EXTRAS`), and the by-name alternative.

    >>> install_hint("plot")
    'pip install -e ".[plot]" in a clone of lightning_moe (or pip install matplotlib)'
    """
    if extra not in EXTRAS:
        raise ValueError(f"Unknown extra {extra!r}; the extras are {sorted(EXTRAS)}.")
    return f'pip install -e ".[{extra}]" in a clone of lightning_moe (or pip install {EXTRAS[extra]})'
