"""What recompute and offload share: the undo handle of an application and the name check."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["AppliedHandle", "check_module_names"]


@dataclass
class AppliedHandle:
    """What an ``apply_*`` function changed in a model; :meth:`remove` undoes it."""

    modules: dict[str, list[str]] = field(default_factory=dict)
    """For each requested name, the qualified names of the modules it applies to."""
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Undo every change, in reverse order of application."""
        while self._undo:
            self._undo.pop()()
        self.modules = {}


def check_module_names(modules: Sequence[str] | str, valid: Sequence[str], kind: str) -> list[str]:
    """The names in ``modules`` without duplicates; ``ValueError`` naming the valid ones otherwise."""
    if isinstance(modules, str):
        modules = [modules]
    unknown = [name for name in modules if name not in valid]
    if unknown:
        raise ValueError(f"Unknown {kind} module(s) {unknown}; choose from {list(valid)}.")
    return list(dict.fromkeys(modules))
