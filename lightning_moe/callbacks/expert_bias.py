"""`ExpertBiasUpdater`: the once-per-global-batch router updates, as a Lightning callback.

A thin wrapper over :mod:`lightning_moe.parallel.expert_bias` (docs/numerics.md §7 and §5.3).
`MoEStrategy` adds one by itself when a router uses the expert bias or the global aux loss and
the user did not pass one.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from lightning_moe.parallel.expert_bias import (
    reset_global_aux_loss_states,
    update_expert_biases,
    zero_token_counts,
)

__all__ = ["ExpertBiasUpdater"]


def count_reduction_group(strategy: Any) -> dist.ProcessGroup | None:
    """The group over which a strategy's ranks share a global batch with the same routers.

    ``tp_dp_cp`` of the strategy's ``parallel_context`` (`MoEStrategy`); for other strategies
    running several processes (DDP, FSDP, DeepSpeed: every process holds every router and routes
    its own tokens) the world; None for one process.
    """
    try:
        ctx = strategy.parallel_context
    except (AttributeError, RuntimeError):  # no such property, or not built yet
        ctx = None
    if ctx is not None:
        return ctx.group("tp_dp_cp")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


class ExpertBiasUpdater(Callback):
    """Updates the routers' expert biases and resets the global aux-loss statistics once per global batch.

    At every optimizer step it sums the expert-bias token counts of all routers over TP x DP x CP
    (one int64 all-reduce), applies the sign rule ``expert_bias += rate * sign(mean(c) - c)`` in
    fp32, zeroes the counts (:func:`~lightning_moe.parallel.expert_bias.update_expert_biases`) and
    resets the running statistics of the global aux loss
    (:func:`~lightning_moe.parallel.expert_bias.reset_global_aux_loss_states`). Routers in eval
    mode keep their bias. The reduction group is ``strategy.parallel_context.group("tp_dp_cp")``
    under `MoEStrategy`, the world under other multi-process strategies, none in one process.

    Why ``on_before_optimizer_step``: Lightning calls it once per optimizer step, after the closure
    has run the backward of the last micro-batch of the global batch. So with
    ``accumulate_grad_batches=N`` the counts of all N micro-batches are summed into one update (as
    Megatron's ``finalize_model_grads``), and with reentrant ``moe`` recompute, whose recomputed
    forward (the one that counts, the first runs under ``no_grad``) happens inside backward, every
    micro-batch has been counted exactly once. ``on_train_batch_end`` would need Lightning's
    private accumulation state (``fit_loop._should_accumulate()``) and, under manual
    optimization, fires after every batch whether or not the user stepped.

    Manual optimization: the hook fires when ``training_step`` calls ``optimizer.step()`` on a
    Lightning-wrapped optimizer (``self.optimizers()``), so a global batch ends wherever the user
    steps, including user-side accumulation over several batches. If several optimizers step in
    one batch, the first step consumes the counts; a later one with no new training forward in
    between finds zero counts, which leave the biases unchanged (``sign(0) = 0``). Raw optimizers
    (``use_pl_optimizer=False``) bypass the hook: call the functions above yourself.

    Counts and statistics left by forwards outside the training loop are cleared at
    ``on_train_start``.
    """

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Start the first global batch from zero counts and statistics (local, no communication)."""
        zero_token_counts(pl_module)
        reset_global_aux_loss_states(pl_module)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        """End of a global batch: update the expert biases, zero the counts, reset the global aux loss."""
        update_expert_biases(pl_module, group=count_reduction_group(trainer.strategy))
        reset_global_aux_loss_states(pl_module)
