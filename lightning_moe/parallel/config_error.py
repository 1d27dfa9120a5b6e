"""`ConfigError`: a setting that cannot work, the same on every rank, reported once by the CLI.

The ``lightning-moe`` CLI checks what it can before any process starts and raises these in the
launching process; an error of this kind raised after the launch (a check that needs the
Trainer's state) is the same on every rank, so only rank zero prints it
(:func:`lightning_moe.cli.main`). Plain ``ValueError`` s stay per-rank: they may differ between ranks.
"""

from __future__ import annotations

__all__ = ["ConfigError", "raise_problems"]


class ConfigError(ValueError):
    """A configuration mistake (the message names the setting, its value and the fix); identical on every rank."""


def raise_problems(error: type[ConfigError], lead: str, problems: list[str]) -> None:
    """Raise ``error`` saying ``lead`` and every one of ``problems`` (one line, or a list); nothing when empty."""
    if not problems:
        return
    if len(problems) == 1:
        raise error(f"{lead}: {problems[0]}")
    listed = "\n".join(f"  - {p}" for p in problems)
    raise error(f"{lead}:\n{listed}")
