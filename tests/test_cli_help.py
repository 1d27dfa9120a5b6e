"""``lightning-moe ... --help`` reads as plain text: no Sphinx markup, every strategy option described.

The help comes from the docstrings, written for Sphinx. In process (``cli_main`` raises
``SystemExit`` after printing): the help of ``fit``, of the reference model and of the strategy
holds no double backticks and no ``:class:``/``:func:``/``:meth:``/``:mod:`` role, the literals and
role targets still read (``IGNORE_INDEX``, ``MoETransformer``), and every ``MoEStrategy`` option,
the pipeline ones included, has a description before its ``(type: ...)``.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
import warnings

import pytest

from lightning_moe.cli import cli_main
from lightning_moe.cli_help import plain_text
from lightning_moe.strategies import MoEStrategy

MARKUP = re.compile(r"``|:(?:class|func|meth|mod|attr|data|exc|obj):`")


HELPS = {
    "fit": ("fit", "--help"),
    "model": ("fit", "--model.help", "MoELanguageModel"),
    "strategy": ("fit", "--trainer.strategy.help", "MoEStrategy"),
}


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    texts = {}
    for name, args in HELPS.items():
        out = io.StringIO()
        with contextlib.redirect_stdout(out), warnings.catch_warnings(), pytest.raises(SystemExit) as exit_info:
            warnings.simplefilter("ignore")  # LightningCLI: args given while pytest has its own argv
            cli_main(list(args))
        assert exit_info.value.code in (0, None), name
        texts[name] = out.getvalue()
    return texts


def test_plain_text_drops_the_markup_and_keeps_the_words():
    assert plain_text("``x`` and ``a b``") == "x and a b"
    assert plain_text(":class:`~lightning_moe.models.MoETransformer` or :func:`lightning_moe.parallel.parallelize`") == (
        "MoETransformer or lightning_moe.parallel.parallelize"
    )
    assert plain_text(":meth:`Title <a.b.c>`, :py:mod:`torch.distributed`, `docs <https://x.y>`_") == (
        "Title, torch.distributed, docs"
    )


@pytest.mark.parametrize(("name", "expected"), [
    ("fit", "--trainer.strategy"), ("model", "MoETransformer"), ("strategy", 'registered as "moe"'),
])
def test_help_has_no_sphinx_markup(helps, name, expected):
    found = [line.strip() for line in helps[name].splitlines() if MARKUP.search(line)]
    assert not found, f"{len(found)} lines with markup, e.g. {found[:3]}"
    assert expected in helps[name]  # the words inside the markup are kept


def test_every_strategy_option_is_described(helps):
    for name in inspect.signature(MoEStrategy).parameters:
        # The option's own entry (indented; usage lines start with "["), then its first help line.
        match = re.search(rf"^\s+--trainer\.strategy\.{name} [^\n]*\n\s+(\S[^\n]*)", helps["strategy"], re.M)
        assert match, name
        assert not match.group(1).startswith("(type:"), f"{name} has no description: {match.group(1)}"
