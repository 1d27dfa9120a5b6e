"""Attribute docstrings of a dataclass, copied into its ``__doc__`` so that ``help()`` shows them.

The config dataclasses document each field with a string right below it (PEP 257 attribute
docstrings): jsonargparse, LightningCLI's ``--help`` and IDEs read those, but Python's ``help()``
and ``pydoc`` only show ``__doc__``. :func:`document_fields` appends an ``Attributes:`` section
built from them, read once from the class's source when the module is imported.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap
from dataclasses import fields, is_dataclass
from typing import TypeVar

__all__ = ["document_fields", "field_docstrings"]

T = TypeVar("T", bound=type)


def field_docstrings(cls: type) -> dict[str, str]:
    """``{field name: its docstring}`` for the annotated attributes of ``cls`` that have one."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (frozen or interactive): nothing to copy
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def document_fields(cls: T) -> T:
    """Class decorator: append an ``Attributes:`` section of every documented field to ``__doc__``."""
    if not is_dataclass(cls):
        raise TypeError(f"document_fields expects a dataclass, got {cls!r}.")
    docs = field_docstrings(cls)
    lines = []
    for f in fields(cls):
        if f.name in docs:
            text = docs[f.name].replace("\n", "\n        ")
            lines.append(f"    {f.name}: {text}")
    if lines:
        cls.__doc__ = (inspect.cleandoc(cls.__doc__ or "") + "\n\nAttributes:\n" + "\n".join(lines)).rstrip()
    return cls
