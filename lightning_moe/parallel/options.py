"""`ParallelOptions`: how a layout is applied (dispatcher, sharding, precision, CP exchange), passed whole.

The process layout itself (sizes, order, groups) is :class:`~lightning_moe.parallel.ParallelContext`;
these are the choices made on top of it that :func:`~lightning_moe.parallel.parallelize` and the
model setup need. One frozen object, validated when it is built, instead of the same five
arguments threaded through every signature between the strategy and the layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_moe.parallel.context_parallel import CP_COMM_TYPES
from lightning_moe.parallel.dispatchers import check_dispatcher
from lightning_moe.parallel.fully_shard import check_sharding_strategy

__all__ = ["ParallelOptions", "resolve_options"]


@dataclass(frozen=True)
class ParallelOptions:
    """How the layout is applied to a model; every name is checked when the object is built.

    Attributes:
        dispatcher: token dispatcher of the MoE layers, ``"alltoall"``, ``"allgather"`` or ``"flex"``.
        sharding_strategy: ``"NO_SHARD"`` (replicated data parallelism), ``"SHARD_GRAD_OP"`` or
            ``"FULL_SHARD"`` (FSDP2, see :mod:`~lightning_moe.parallel.fully_shard`).
        mp_policy: FSDP2 mixed precision of the sharded strategies (None: compute in the
            parameters' dtype).
        flex_backend: implementation of the ``flex`` dispatcher, ``"auto"``, ``"torch"`` or ``"deepep"``.
        cp_comm_type: context-parallel K/V exchange, ``"p2p"`` (ring) or ``"all_gather"``.
    """

    dispatcher: str = "alltoall"
    sharding_strategy: str = "NO_SHARD"
    mp_policy: MixedPrecisionPolicy | None = None
    flex_backend: str = "auto"
    cp_comm_type: str = "p2p"

    def __post_init__(self) -> None:
        check_dispatcher(self.dispatcher, self.flex_backend)
        check_sharding_strategy(self.sharding_strategy)
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"Unknown cp_comm_type {self.cp_comm_type!r}; choose one of {list(CP_COMM_TYPES)}.")


def resolve_options(options: ParallelOptions | None, **keywords: object) -> ParallelOptions:
    """``options``, or one built from the ``keywords`` that are not None (the other fields keep
    their defaults); both at once is a ``TypeError`` naming the keywords."""
    given = {name: value for name, value in keywords.items() if value is not None}
    if options is None:
        return ParallelOptions(**given)
    if given:
        raise TypeError(
            f"Got a ParallelOptions and also {', '.join(sorted(given))}: pass the options object alone "
            "(dataclasses.replace(options, ...) changes a field), or the keywords alone."
        )
    return options
