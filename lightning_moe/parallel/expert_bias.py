"""End-of-global-batch router updates: the aux-loss-free expert bias and the global aux-loss reset.

Reference docs/numerics.md §7 and §5.3 (Megatron's ``finalize_model_grads``:
``_update_router_expert_bias`` and the global aux-loss tracker reset). Every
:class:`~lightning_moe.layers.router.TopKRouter` counts, in its int64 buffer
``local_tokens_per_expert``, the kept real assignments (top-k choices that survive the capacity
limit, of valid tokens; no ``pad_to_capacity`` filler rows) of each training micro-batch run
with grad enabled (so a recomputed forward does not count twice, docs/architecture.md §4). After the
backward of the last micro-batch of a global batch, once per optimizer step:

1. :func:`update_expert_biases` sums the counts of every router with an expert bias over the
   tensor x data x context parallel group (one all-reduce for all routers, in int64), applies the
   sign rule ``expert_bias += rate * sign(mean(c) - c)`` (``sign(0) = 0``, fp32 bias, exact sign
   from the integer counts) and zeroes the counts of every router;
2. :func:`reset_global_aux_loss_states` zeroes the running statistics of the global aux loss.

Plain PyTorch (no Lightning): a torchrun training loop calls both after ``loss.backward()`` of the
last micro-batch; ``lightning_moe.callbacks.ExpertBiasUpdater`` calls them inside a Trainer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_moe.layers.router import TopKRouter
from lightning_moe.layers.routing import update_expert_bias

__all__ = [
    "needs_global_batch_updates",
    "reset_global_aux_loss_states",
    "routers_of",
    "update_expert_biases",
    "zero_token_counts",
]


def routers_of(routers_or_model: nn.Module | Iterable[TopKRouter]) -> list[TopKRouter]:
    """Every :class:`TopKRouter` of a model (in ``modules()`` order), or of an iterable of routers.

    A router shared by several modules is listed once. Raises ``TypeError`` for anything else.
    """
    if isinstance(routers_or_model, nn.Module):
        candidates = list(routers_or_model.modules())
        routers = [m for m in candidates if isinstance(m, TopKRouter)]
    else:
        try:
            routers = list(routers_or_model)
        except TypeError:
            routers = None
        if routers is None or not all(isinstance(r, TopKRouter) for r in routers):
            raise TypeError(
                "expected an nn.Module (whose TopKRouters are used) or an iterable of TopKRouter, got "
                f"{type(routers_or_model).__name__}"
            )
    unique: dict[int, TopKRouter] = {}
    for router in routers:
        unique.setdefault(id(router), router)
    return list(unique.values())


def needs_global_batch_updates(routers_or_model: nn.Module | Iterable[TopKRouter]) -> bool:
    """True when some router has an expert bias or the global aux loss, i.e. needs the end-of-global-batch
    calls of this module (``config.expert_bias`` or ``"global_aux_loss"`` in ``config.load_balancing``)."""
    return any(
        router.config.expert_bias or "global_aux_loss" in router.config.load_balancing
        for router in routers_of(routers_or_model)
    )


@torch.no_grad()
def zero_token_counts(routers_or_model: nn.Module | Iterable[TopKRouter]) -> None:
    """Zero ``local_tokens_per_expert`` of every router (local, no communication)."""
    for router in routers_of(routers_or_model):
        router.local_tokens_per_expert.zero_()


@torch.no_grad()
def update_expert_biases(
    routers_or_model: nn.Module | Iterable[TopKRouter], group: dist.ProcessGroup | None = None
) -> list[Tensor]:
    """Apply the aux-loss-free expert-bias update of one global batch and zero the token counts.

    Call once per optimizer step, after the backward of the last micro-batch, on every rank of
    ``group`` with the same model structure (it is a collective when ``group`` has more than one
    rank).

    Args:
        routers_or_model: a model (all its :class:`TopKRouter` modules are used) or routers.
        group: the tensor x data x context parallel group (``ctx.group("tp_dp_cp")``) over which the
            counts are summed, i.e. every rank that routed a share of the global batch with the same
            router. ``None`` means no communication (one process); pass
            ``torch.distributed.group.WORLD`` for the world.

    The counts of all routers with an expert bias are concatenated into one int64 tensor and summed
    with a single all-reduce. Each such router whose module is in training mode then gets
    ``expert_bias += config.bias_update_rate * sign(mean(c) - c)`` in fp32
    (:func:`~lightning_moe.layers.routing.update_expert_bias`); routers in eval mode (frozen) keep
    their bias, as upstream. Every router's counts are zeroed afterwards, also those of routers
    without an expert bias (they count all the same). Routers in eval mode still take part in the
    reduction, so the collective has the same size on every rank whatever their modes.

    Returns the summed counts (int64, ``[E]``) of each router with an expert bias, in the order of
    :func:`routers_of`; empty when there is none (then no communication happens).
    """
    routers = routers_of(routers_or_model)
    biased = [router for router in routers if router.expert_bias is not None]
    summed: list[Tensor] = []
    if biased:
        device = biased[0].local_tokens_per_expert.device
        flat = torch.cat(
            [r.local_tokens_per_expert.reshape(-1).to(device=device, dtype=torch.int64) for r in biased]
        )
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        summed = list(flat.split([r.local_tokens_per_expert.numel() for r in biased]))
        for router, counts in zip(biased, summed):
            if router.training:
                bias = router.expert_bias
                bias.copy_(update_expert_bias(bias, counts.to(bias.device), router.config.bias_update_rate))
    for router in routers:
        router.local_tokens_per_expert.zero_()
    return summed


@torch.no_grad()
def reset_global_aux_loss_states(routers_or_model: nn.Module | Iterable[TopKRouter]) -> None:
    """Zero the global aux loss's running statistics (``global_tokens_per_expert``,
    ``global_aux_loss_steps``) of every router; call at the end of every global batch
    (docs/numerics.md §5.3)."""
    for router in routers_of(routers_or_model):
        router.reset_global_aux_loss_state()
