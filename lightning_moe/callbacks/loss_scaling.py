"""`MoELossScaling`: aux/z-loss gradients that scale like the main loss, under any Lightning strategy.

A thin wrapper over :class:`~lightning_moe.layers.loss_scale.LossGradScale`. The routers' losses
reach the gradients through an autograd hook, not through the loss Lightning scales; without
this callback (or `MoEStrategy`, which does the same by itself) ``precision="16-mixed"`` leaves
their gradients ~65536x too small after unscaling and ``accumulate_grad_batches=N`` N times too
large.
"""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_moe.layers.loss_scale import LossGradScale

__all__ = ["MoELossScaling"]


class MoELossScaling(Callback):
    """Scales the MoE routers' aux and z-loss gradients exactly like Lightning scales the loss.

    Before every training backward (``on_before_backward``) the scale of every router's attached
    losses is set to ``1 / trainer.accumulate_grad_batches`` (read each step, so a
    ``GradientAccumulationScheduler`` is followed; 1 under manual optimization, where the loop is
    yours) times the current scale of the precision plugin's GradScaler (``16-mixed``), with no
    host synchronisation. Add it to any strategy (``Trainer(callbacks=[MoELossScaling()])``:
    single device, DDP, FSDP, DeepSpeed); under `MoEStrategy` it does nothing, the strategy
    already does this.
    """

    def __init__(self) -> None:
        self._scale: LossGradScale | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Bind one device scalar to every router of the model (before its first training forward)."""
        self._scale = None
        if getattr(trainer.strategy, "manages_moe_loss_scaling", False):
            rank_zero_info(
                f"MoELossScaling: {type(trainer.strategy).__name__} scales the aux/z-loss gradients itself; "
                "the callback does nothing."
            )
            return
        scale = LossGradScale(pl_module.device)
        if scale.bind(pl_module) == 0:
            rank_zero_warn("MoELossScaling: the model has no lightning_moe MoE layer; the callback does nothing.")
            return
        self._scale = scale
        self._update(trainer, pl_module)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        """Set the scale for this backward (after Lightning scaled the loss)."""
        self._update(trainer, pl_module)

    def _update(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._scale is None:
            return
        accumulation = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        self._scale.update(1.0 / accumulation, getattr(trainer.precision_plugin, "scaler", None))
