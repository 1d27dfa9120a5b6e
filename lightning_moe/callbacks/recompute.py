"""`SelectiveRecompute`: Megatron Core's fine-grained recompute (``recompute_modules``) from a Trainer.

A thin callback over :func:`lightning_moe.memory.apply_selective_recompute`: before the first
forward of ``fit`` (``on_fit_start``, after the strategy has built and parallelised the model)
it recomputes the chosen modules of every matching submodule of the LightningModule, and undoes
it in ``teardown``::

    Trainer(callbacks=[SelectiveRecompute(modules=["moe_act", "layernorm"])])

Names: ``moe_act``, ``layernorm``, ``shared_experts``, ``router``, ``core_attn``, ``attention``,
``moe`` (see :mod:`lightning_moe.memory.recompute`). Losses and gradients equal the run without
it; router statistics are recorded once per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_moe.memory.recompute import RecomputeHandle, apply_selective_recompute, check_recompute_modules

__all__ = ["SelectiveRecompute"]


class SelectiveRecompute(Callback):
    """Recompute ``modules`` in backward instead of keeping their activations.

    Args:
        modules: names from :data:`lightning_moe.memory.RECOMPUTE_MODULES`.
    """

    def __init__(self, modules: Sequence[str] = ("moe_act",)) -> None:
        self.modules = check_recompute_modules(modules)  # unknown names fail when the Trainer is configured
        self._handle: RecomputeHandle | None = None

    @property
    def applied(self) -> dict[str, list[str]]:
        """For each name, the qualified names of the modules recomputed (empty before ``fit``)."""
        return {} if self._handle is None else dict(self._handle.modules)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._handle is not None:
            return
        self._handle = apply_selective_recompute(pl_module, self.modules)
        unmatched = [name for name, found in self._handle.modules.items() if not found]
        if unmatched:
            rank_zero_warn(f"SelectiveRecompute: {unmatched} matched no module of {type(pl_module).__name__}.")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
