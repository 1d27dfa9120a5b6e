"""The Trainer callbacks `MoEStrategy` adds or adjusts in setup.

* :func:`add_expert_bias_updater`: expert biases and the global aux loss need an end-of-global-
  batch update (Megatron-LM ``finalize_model_grads``); the callback is added unless the user passed one.
* :func:`use_global_model_summary`: the model summary counts the whole model, not one rank's shards.
"""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_moe.strategies.model_summary import use_global_model_summary

__all__ = ["add_expert_bias_updater", "use_global_model_summary"]


def add_expert_bias_updater(callbacks: list, model: nn.Module) -> None:
    """Append an ``ExpertBiasUpdater`` to ``callbacks`` when a router of ``model`` needs one and none is there."""
    # Imported here so that strategies/ and callbacks/ may import each other's packages.
    from lightning_moe.callbacks.expert_bias import ExpertBiasUpdater
    from lightning_moe.parallel.expert_bias import needs_global_batch_updates

    if any(isinstance(cb, ExpertBiasUpdater) for cb in callbacks) or not needs_global_batch_updates(model):
        return
    callbacks.append(ExpertBiasUpdater())
    rank_zero_info(
        "MoEStrategy: added the ExpertBiasUpdater callback (a router uses the expert bias or the global aux "
        "loss); pass your own instance in Trainer(callbacks=...) to configure it."
    )
