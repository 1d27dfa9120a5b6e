"""`ConfigError`: a setting that cannot work, the same on every rank, reported once by the CLI.

The ``lightning-moe`` CLI checks what it can before any process starts and raises these in the
launching process; an error of this kind raised after the launch (a check that needs the
Trainer's state) is the same on every rank, so only rank zero prints it
(:func:`lightning_moe.cli.main`). Plain ``ValueError`` s stay per-rank: they may differ between ranks.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration mistake (the message names the setting, its value and the fix); identical on every rank."""
