"""The gradient scale of the routers' auxiliary losses, kept equal to the main loss's.

The aux and z losses never enter the user's loss: :func:`~lightning_moe.layers.losses.attach_loss`
hooks them onto the router outputs and backward gives each one the gradient ``scale``. For their
gradients to end up where the main loss's do, ``scale`` must be what the training loop multiplies
the main loss by before its backward:

* ``1 / accumulate_grad_batches`` under gradient accumulation (Lightning divides the loss);
* the GradScaler's current scale under ``precision="16-mixed"``: the main loss is scaled before
  backward and every gradient unscaled before the step. An aux-loss gradient that missed the
  scale would come out ~65536x too small after unscaling, which disables load balancing;
* strategy factors (the context-parallel factor of docs/numerics.md §5.4 under `MoEStrategy`).

:class:`LossGradScale` holds that number as a 0-dim fp32 tensor on the model's device. It is bound
to every router of a model once (the routers keep a reference, which each forward hands to
backward) and rewritten in place before every backward, so the value is current when backward
runs (GradScaler and accumulation factors change between steps), no host read is needed, and a
captured CUDA graph reads the new value too. `MoEStrategy` and the
:class:`~lightning_moe.callbacks.MoELossScaling` callback (any other Lightning strategy) drive it;
plain PyTorch loops call :func:`set_aux_loss_scale`.

A router whose scale nobody set (``aux_loss_scale is None``) uses 1.0 and warns once.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_moe.layers.router import TopKRouter

__all__ = ["LossGradScale", "set_aux_loss_scale"]


def set_aux_loss_scale(model: nn.Module, scale: float | Tensor) -> int:
    """Give every router in ``model`` the aux/z-loss gradient scale ``scale``; returns how many.

    For training loops without Lightning: pass what your loop multiplies the loss by before
    ``backward`` (``grad_scaler.get_scale() / accumulation_steps``, or 1.0 with neither). A 0-dim
    tensor is read when backward runs, so updating it in place keeps every router current.
    """
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    for router in routers:
        router.aux_loss_scale = scale
    return len(routers)


class LossGradScale:
    """One model's aux/z-loss gradient scale, a device scalar updated in place before each backward.

    Args:
        device: where the model computes (the scale must live where the losses' gradients do).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.value = torch.ones((), dtype=torch.float32, device=device)
        """The current scale (0-dim fp32); bound routers read it in backward."""

    def bind(self, model: nn.Module) -> int:
        """Point every router of ``model`` at :attr:`value`; returns the number of routers."""
        return set_aux_loss_scale(model, self.value)

    @torch.no_grad()
    def update(self, factor: float, grad_scaler: torch.amp.GradScaler | None = None) -> None:
        """Set the scale to ``factor`` times ``grad_scaler``'s current scale (if one is enabled).

        Reads the GradScaler's scale on the device through its public ``scale()`` (which also
        creates the scale on first use), so nothing is copied to the host.
        """
        self.value.fill_(factor)
        if grad_scaler is not None and grad_scaler.is_enabled():
            self.value.copy_(grad_scaler.scale(self.value))
