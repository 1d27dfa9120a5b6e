"""``--help`` text without Sphinx markup: the docstrings' reST roles and literals made plain.

The CLI's help comes from the docstrings (jsonargparse reads them through docstring-parser), which
are written for Sphinx: ````x````, ``:class:`~a.b.C```, ``:func:`a.b```. A terminal shows that
markup as is. :func:`plain_text` turns it into what a person reads (``x``, ``C``, ``a.b``), and
:class:`HelpParser` (the CLI's ``parser_class``) applies it to every description and option help
before argparse wraps the lines, in the main parser, the subcommands and the ``--*.help CLASS``
parsers that jsonargparse builds from ``type(parser)``.
"""

from __future__ import annotations

import re
from typing import Any

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.cli import LightningArgumentParser

__all__ = ["HelpFormatter", "HelpParser", "plain_text"]

# :role:`target` or :domain:role:`target`, with an optional explicit title: :class:`Title <a.b.C>`.
_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`(?:([^`<]*?)\s*<([^`>]*)>|([^`]*))`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)
_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]+>`_{1,2}")  # `text <url>`_


def _role(match: re.Match) -> str:
    title, _, target = match.groups()
    if title:
        return title
    target = target.strip()
    if target.startswith("~"):  # Sphinx shows only the last component
        return target[1:].rsplit(".", 1)[-1]
    return target.lstrip("!")


def plain_text(text: str) -> str:
    """``text`` with reST roles (``:class:`~a.b.C``` -> ``C``, ``:func:`a.b``` -> ``a.b``), inline
    literals (````x```` -> ``x``) and links (```text <url>`_`` -> ``text``) made plain."""
    text = _ROLE.sub(_role, text)
    text = _LINK.sub(r"\1", text)
    return _LITERAL.sub(r"\1", text)


class HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help formatter, with :func:`plain_text` applied before the lines are wrapped."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return super()._split_lines(plain_text(text), width)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return super()._fill_text(plain_text(text), width, indent)

    def start_section(self, heading: str | None) -> None:
        # Group headings: jsonargparse titles a class's options with its docstring's first line.
        super().start_section(None if heading is None else plain_text(heading))


class HelpParser(LightningArgumentParser):
    """Lightning's argument parser with :class:`HelpFormatter` as its default formatter."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
