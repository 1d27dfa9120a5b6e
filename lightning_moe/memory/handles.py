"""What recompute and offload share: the undo handle, the name check and user-named target modules.

Both features find their modules by name (``layernorm``, ``core_attn``, ``attn_norm``, ...). By
default a name matches the package's own layer types or the reference model's module names; for
the attention-side names a user's model can name its own modules instead (``targets=``), with

* module types: ``torch.nn.LayerNorm`` matches every ``LayerNorm`` (``isinstance``);
* qualified-name patterns: ``"blocks.*.attn"`` matches a module whose qualified name ends with
  three components matching ``blocks``, any one component, and ``attn`` (``fnmatch`` per
  component, so ``*`` never crosses a dot); ``"norm1"`` matches every module named ``norm1``.
  Matching the end of the name keeps patterns valid whatever wraps the model (a
  ``LightningModule`` attribute such as ``net.``, a DDP ``module.`` prefix).

The model itself (qualified name ``""``) is never a target. A model may declare its own modules
for a name in its plan (``parallel_plan().recompute``, :mod:`lightning_moe.parallel.model_plan`),
written the same way: :func:`declared_modules`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from torch import nn

from lightning_moe.parallel.model_plan import planned_modules

__all__ = [
    "AppliedHandle",
    "ModuleSpec",
    "check_module_names",
    "check_targets",
    "declared_modules",
    "describe_specs",
    "find_modules",
]

ModuleSpec = type[nn.Module] | str
"""A module type (matched with ``isinstance``) or a qualified-name pattern (see the module docstring)."""

PATTERN_HELP = (
    "lists of module types (matched with isinstance) or qualified-name patterns such as 'blocks.*.attn' "
    "(matched against the end of the qualified name, '*' within one name component)"
)
"""How ``targets`` entries are written, for messages."""


@dataclass
class AppliedHandle:
    """What an ``apply_*`` function changed in a model; :meth:`remove` undoes it."""

    modules: dict[str, list[str]] = field(default_factory=dict)
    """For each requested name, the qualified names of the modules it applies to."""
    looked_for: dict[str, str] = field(default_factory=dict)
    """For each requested name, what it matches (the default rule, or the user's targets)."""
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    verb: ClassVar[str] = "applied"
    """What happens to a matched module, for messages (``recomputed``, ``offloaded``)."""
    customizable: ClassVar[tuple[str, ...]] = ()
    """The names that accept ``targets``."""

    @property
    def unmatched(self) -> list[str]:
        """The requested names that matched no module."""
        return [name for name, found in self.modules.items() if not found]

    def unmatched_message(self, caller: str, owner: str) -> str | None:
        """A one-line explanation of :attr:`unmatched` (None when every name matched something).

        Names each unmatched name with what it looks for and, for the names that accept
        ``targets``, how to name the user's own modules instead.
        """
        unmatched = self.unmatched
        if not unmatched:
            return None
        details = "; ".join(f"{name!r}: {self.looked_for.get(name, '?')}" for name in unmatched)
        message = (
            f"{caller}: {unmatched} matched no module of {owner}, so nothing is {self.verb} for them "
            f"(each looks for {details})."
        )
        custom = [name for name in unmatched if name in self.customizable]
        if custom:
            example = ", ".join(f"{name!r}: [...]" for name in custom)
            message += f" Name your own modules with targets={{{example}}}: {PATTERN_HELP}."
        return message

    def check_unmatched(self, caller: str, owner: str, strict: bool) -> str | None:
        """:meth:`unmatched_message`; with ``strict``, a ``ValueError`` with it instead, after :meth:`remove`."""
        message = self.unmatched_message(caller, owner)
        if message is not None and strict:
            self.remove()
            raise ValueError(f"{message} Raised because strict=True.")
        return message

    def remove(self) -> None:
        """Undo every change, in reverse order of application."""
        while self._undo:
            self._undo.pop()()
        self.modules = {}
        self.looked_for = {}


def check_module_names(modules: Sequence[str] | str, valid: Sequence[str], kind: str) -> list[str]:
    """The names in ``modules`` without duplicates; ``ValueError`` naming the valid ones otherwise."""
    if isinstance(modules, str):
        modules = [modules]
    unknown = [name for name in modules if name not in valid]
    if unknown:
        raise ValueError(f"Unknown {kind} module(s) {unknown}; choose from {list(valid)}.")
    return list(dict.fromkeys(modules))


def _check_spec(name: str, spec: object) -> ModuleSpec:
    if isinstance(spec, str):
        if not spec:
            raise ValueError(f"targets[{name!r}] has an empty pattern; give a module type or a name such as 'attn'.")
        if "" in spec.split("."):
            raise ValueError(
                f"targets[{name!r}] pattern {spec!r} has an empty name component; write e.g. 'blocks.*.attn'."
            )
        return spec
    if isinstance(spec, type) and issubclass(spec, nn.Module):
        return spec
    raise TypeError(
        f"targets[{name!r}] entries must be nn.Module subclasses or qualified-name patterns, got {spec!r} "
        f"({type(spec).__name__})."
    )


def check_targets(
    targets: Mapping[str, ModuleSpec | Sequence[ModuleSpec]] | None,
    modules: Sequence[str],
    valid: Sequence[str],
    customizable: Sequence[str],
    kind: str,
) -> dict[str, tuple[ModuleSpec, ...]]:
    """``targets`` with every entry checked and a single spec turned into a one-element tuple.

    Raises ``ValueError`` for a name that is unknown, takes no targets (found by the package's
    types), or is not among the requested ``modules``, and for empty patterns; ``TypeError`` for
    entries that are neither ``nn.Module`` subclasses nor strings.
    """
    if targets is None:
        return {}
    if not isinstance(targets, Mapping):
        raise TypeError(
            f"targets must map {kind} names to module types or name patterns, e.g. "
            f"{{'{customizable[0]}': ['blocks.*.attn']}}; got {type(targets).__name__}."
        )
    checked: dict[str, tuple[ModuleSpec, ...]] = {}
    for name, specs in targets.items():
        if name not in customizable:
            if name not in valid:
                raise ValueError(f"targets for unknown {kind} module {name!r}; choose from {list(customizable)}.")
            raise ValueError(
                f"targets for {name!r}: this {kind} name is found by type (the package's MoE layers) and "
                f"takes no targets; the names that accept targets: {list(customizable)}."
            )
        if name not in modules:
            raise ValueError(
                f"targets for {name!r}, which is not in modules {list(modules)}; add {name!r} to modules or "
                "drop its targets."
            )
        if isinstance(specs, (str, type)):
            specs = (specs,)
        checked[name] = tuple(_check_spec(name, spec) for spec in specs)
    return checked


def _name_matches(pattern: str, name: str) -> bool:
    want, have = pattern.split("."), name.split(".")
    if len(have) < len(want):
        return False
    return all(fnmatch.fnmatchcase(part, glob) for part, glob in zip(have[len(have) - len(want) :], want))


def find_modules(model: nn.Module, specs: Sequence[ModuleSpec]) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every submodule of ``model`` matching one of ``specs``, in model order."""
    found = []
    for name, module in model.named_modules():
        if not name:
            continue
        if any(_name_matches(spec, name) if isinstance(spec, str) else isinstance(module, spec) for spec in specs):
            found.append((name, module))
    return found


def describe_specs(specs: Sequence[ModuleSpec]) -> str:
    """``specs`` as a user wrote them, for messages: ``your targets [LayerNorm, 'blocks.*.attn']``."""
    shown = ", ".join(spec.__name__ if isinstance(spec, type) else repr(spec) for spec in specs)
    return f"your targets [{shown}]"


def declared_modules(model: nn.Module, name: str) -> list[tuple[str, nn.Module]] | None:
    """``(qualified name, module)`` of what the plans inside ``model`` declare for ``name`` (their
    ``recompute`` entries, matched within each planned module); None when no plan declares ``name``."""
    plans = [(prefix, owner, plan.recompute[name]) for prefix, owner, plan in planned_modules(model)
             if name in plan.recompute]
    if not plans:
        return None
    return [(f"{prefix}.{found}" if prefix else found, module)
            for prefix, owner, specs in plans for found, module in find_modules(owner, specs)]
