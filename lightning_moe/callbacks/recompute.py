"""`SelectiveRecompute`: Megatron Core's fine-grained recompute (``recompute_modules``) from a Trainer.

A thin callback over :func:`lightning_moe.memory.apply_selective_recompute`: before the first
forward of ``fit`` (``on_fit_start``, after the strategy has built and parallelised the model)
it recomputes the chosen modules of every matching submodule of the LightningModule, and undoes
it in ``teardown``::

    Trainer(callbacks=[SelectiveRecompute(modules=["moe_act", "layernorm"])])

Names: ``moe_act``, ``layernorm``, ``shared_experts``, ``router``, ``core_attn``, ``attention``,
``moe`` (see :mod:`lightning_moe.memory.recompute`). Losses and gradients equal the run without
it; router statistics are recorded once per micro-batch.

On your own model (no reference-model names), name the modules of the attention-side names with
``targets``: module types or qualified-name patterns (``*`` within one name component, matched
against the end of the qualified name)::

    SelectiveRecompute(
        modules=["moe_act", "layernorm", "attention"],
        targets={"layernorm": [torch.nn.LayerNorm], "attention": ["blocks.*.attn"]},
    )

A name that matches nothing warns once (rank 0), naming it and what it looks for, and changes
nothing; ``strict=True`` raises ``ValueError`` instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import WarningCache

from lightning_moe.memory.handles import ModuleSpec
from lightning_moe.memory.recompute import (
    RecomputeHandle,
    apply_selective_recompute,
    check_recompute_modules,
    check_recompute_targets,
)

__all__ = ["SelectiveRecompute"]


class SelectiveRecompute(Callback):
    """Recompute ``modules`` in backward instead of keeping their activations.

    Args:
        modules: names from :data:`lightning_moe.memory.RECOMPUTE_MODULES`.
        targets: for ``layernorm``, ``core_attn`` and ``attention``, the user's own modules
            instead of the default rule: a list of ``nn.Module`` types and/or qualified-name
            patterns per name, e.g. ``{"layernorm": [torch.nn.LayerNorm], "attention": ["blocks.*.attn"]}``.
            ``layernorm`` targets must take one tensor and return a fresh one (a norm).
        strict: raise ``ValueError`` instead of warning when a name matches no module.
    """

    def __init__(
        self,
        modules: Sequence[str] = ("moe_act",),
        targets: Mapping[str, ModuleSpec | Sequence[ModuleSpec]] | None = None,
        strict: bool = False,
    ) -> None:
        # Unknown names and malformed targets fail when the Trainer is configured.
        self.modules = check_recompute_modules(modules)
        self.targets = check_recompute_targets(targets, self.modules)
        self.strict = strict
        self._handle: RecomputeHandle | None = None
        self._warnings = WarningCache()  # each message once per callback

    @property
    def applied(self) -> dict[str, list[str]]:
        """For each name, the qualified names of the modules recomputed (empty before ``fit``)."""
        return {} if self._handle is None else dict(self._handle.modules)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Apply the recompute to ``pl_module``; warn (or raise with ``strict``) for unmatched names."""
        if self._handle is not None:
            return
        handle = apply_selective_recompute(pl_module, self.modules, self.targets)
        message = handle.check_unmatched("SelectiveRecompute", type(pl_module).__name__, self.strict)
        self._handle = handle
        if message is not None:
            self._warnings.warn(message)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Restore every recomputed module."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
