"""`parallelize`: the one entry point that applies every parallel technique, in a fixed order.

Model code is written for one device; this function turns it into its share of a parallel
layout. Order (each step assumes the previous ones):

0. context parallelism (:func:`~lightning_moe.parallel.context_parallel.apply.apply_context_parallel`)
   when ``cp > 1``: the attention each model's plan declares runs over the CP ranks' chunks of
   each sequence;
1. tensor / sequence parallelism (:func:`~lightning_moe.parallel.tensor_parallel.apply_tensor_parallel`)
   of every module whose plan declares it (the reference
   :class:`~lightning_moe.models.MoETransformer`'s: attention and dense layers sharded over TP,
   MoE layers fed this rank's sequence slice). Other modules stay replicated over TP; each TP rank
   then simply routes its own tokens (sequence-sharded data), which is all MoE folding needs; then
   (:func:`~lightning_moe.parallel.user_tensor_parallel.apply_user_tensor_parallel`) the tensor
   parallelism a model applied itself in ``configure_model`` (``parallelize_module`` on
   ``device_mesh["tensor_parallel"]``): its MoE layers route each TP rank's slice of their
   replicated input, its plain parameters are reduced as replicated over TP;
2. expert parallelism (:func:`~lightning_moe.parallel.expert_parallel.apply_expert_parallel`):
   experts sharded over EP x ETP, the token dispatcher and the router's reduce groups bound;
3. sharded data parallelism (:func:`~lightning_moe.parallel.fully_shard.apply_fully_shard`,
   FSDP2) unless ``sharding_strategy="NO_SHARD"``: dense parameters over DP x CP, experts over
   EDP. Gradients are then synchronised by
   :class:`~lightning_moe.parallel.sharded_grad_sync.ShardedGradSync` instead of ``GradSync``.

Models declare what steps 0, 1 and 3 need through ``parallel_plan()``
(:mod:`~lightning_moe.parallel.model_plan`). The Lightning strategy calls it after
``configure_model``; a plain torchrun script calls it directly after building the model.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_moe.parallel.context_parallel.apply import apply_context_parallel
from lightning_moe.parallel.expert_parallel import apply_expert_parallel
from lightning_moe.parallel.fully_shard import apply_fully_shard, check_fully_shard
from lightning_moe.parallel.layout.groups import ParallelContext
from lightning_moe.parallel.model_plan import planned_modules
from lightning_moe.parallel.options import ParallelOptions, resolve_options
from lightning_moe.parallel.tensor_parallel import apply_tensor_parallel
from lightning_moe.parallel.user_tensor_parallel import apply_user_tensor_parallel

__all__ = ["parallelize"]


def parallelize(
    model: nn.Module,
    ctx: ParallelContext,
    dispatcher: str | ParallelOptions | None = None,
    sharding_strategy: str | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    flex_backend: str | None = None,
    cp_comm_type: str | None = None,
    *,
    options: ParallelOptions | None = None,
    tp_replicated_input: bool = False,
) -> nn.Module:
    """Apply the parallel layout of ``ctx`` to ``model`` in place and return it.

    The choices come whole as ``options`` (a :class:`~lightning_moe.parallel.options.ParallelOptions`,
    also accepted in the place of ``dispatcher``), or as the keywords below; a keyword left out
    takes the ``ParallelOptions`` default, and mixing both ways is a ``TypeError``.

    Args:
        model: a module built for one device (meta-device parameters are fine).
        ctx: the layout, from :func:`~lightning_moe.parallel.build_parallel_context`.
        dispatcher: token dispatcher of the MoE layers, ``"alltoall"`` (default), ``"allgather"`` or ``"flex"``.
        sharding_strategy: ``"NO_SHARD"`` (default: replicated data parallelism), ``"SHARD_GRAD_OP"`` or
            ``"FULL_SHARD"`` (FSDP2, see :mod:`~lightning_moe.parallel.fully_shard`).
        mp_policy: FSDP2 mixed precision of the sharded strategies (None: compute in the
            parameters' dtype).
        flex_backend: implementation of the ``flex`` dispatcher, ``"auto"`` (default), ``"torch"`` or ``"deepep"``.
        cp_comm_type: context-parallel K/V exchange, ``"p2p"`` (default: ring) or ``"all_gather"``.
        options: all of the above in one object.
        tp_replicated_input: the model's inputs are the same on every rank of a TP group (as
            ``MoEStrategy``'s batches are): MoE layers outside a tensor-parallel plan then route
            each TP rank's slice of their input. False (default): each rank routes the tokens it is
            given (MoE folding: the TP ranks are more ranks to spread tokens over), unless the
            model applied tensor parallelism itself, whose layers' outputs are replicated.
    """
    if isinstance(dispatcher, ParallelOptions):
        options, dispatcher = (dispatcher, None) if options is None else (options, dispatcher)
    options = resolve_options(
        options, dispatcher=dispatcher, sharding_strategy=sharding_strategy, mp_policy=mp_policy,
        flex_backend=flex_backend, cp_comm_type=cp_comm_type,
    )
    check_fully_shard(model, ctx, options.sharding_strategy)
    apply_context_parallel(model, ctx, options.cp_comm_type)
    apply_tensor_parallel(model, ctx)
    planned = [m for _, m, plan in planned_modules(model) if plan.tensor_parallel is not None]
    apply_user_tensor_parallel(model, ctx, planned=planned, replicated_input=tp_replicated_input)
    apply_expert_parallel(model, ctx, dispatcher=options.dispatcher, flex_backend=options.flex_backend)
    apply_fully_shard(model, ctx, options.sharding_strategy, options.mp_policy)
    return model
