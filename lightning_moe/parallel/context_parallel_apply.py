"""`apply_context_parallel`: run the reference model on each CP rank's chunks of every sequence.

Applied by :func:`~lightning_moe.parallel.parallelize` when ``context_parallel_size > 1``, first
(before tensor parallelism, whose sequence sharding then splits each rank's chunks further). The
caller feeds each CP rank its two chunks of every sequence (:func:`shard_batch`, chunks ``r`` and
``2C-1-r``, Megatron's causal load balance); the model then

* gives the rotary embedding the chunks' global positions (a forward pre-hook passing
  ``position_ids`` to each :class:`~lightning_moe.models.MoETransformer`; pipeline stages, which
  run the transformer's pieces without its ``forward``, ask :func:`context_parallel_positions`);
* attends over the whole sequence: every ``CoreAttention`` (standard attention and MLA) becomes a
  :class:`ContextParallelCoreAttention` over the ``cp`` group (ring or all-gather exchange of the
  keys and values, :func:`~lightning_moe.parallel.context_parallel.context_parallel_attention`);
* routes its own tokens: the MoE layers treat the CP shards as more tokens, and their
  sequence-level statistics already reduce over TP x CP.

Gradients of dense parameters then reduce over DP x CP and experts' over EDP, as at CP=1
(``GradSync``); a loss that is a mean over tokens must be the mean over the whole sequence, i.e.
each CP rank's token sum divided by the token count of all CP ranks, times CP (the gradient
pre-scale divides by DP x CP): :func:`cp_token_mean`.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn

from lightning_moe.models import MoETransformer
from lightning_moe.models.attention import CoreAttention
from lightning_moe.parallel.context import ParallelContext
from lightning_moe.parallel.context_parallel import (
    CP_COMM_TYPES,
    context_parallel_attention,
    load_balanced_positions,
    shard_sequence,
)

__all__ = [
    "ContextParallelCoreAttention", "apply_context_parallel", "context_parallel_positions", "cp_token_mean",
    "shard_batch",
]

_CP_ATTR = "_lightning_moe_context_parallel"  # (cp rank, cp size) on a transformer made context parallel


class ContextParallelCoreAttention(nn.Module):
    """Drop-in for :class:`~lightning_moe.models.attention.CoreAttention` on one CP rank's chunks.

    Args:
        group: the CP process group.
        cp_comm_type: ``"p2p"`` (ring) or ``"all_gather"``.
        softmax_scale: the replaced module's scale (None: ``D ** -0.5``).
    """

    def __init__(self, group, cp_comm_type: str = "p2p", softmax_scale: float | None = None) -> None:
        super().__init__()
        if cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"Unknown cp_comm_type {cp_comm_type!r}; choose one of {list(CP_COMM_TYPES)}.")
        self.group = group
        self.cp_comm_type = cp_comm_type
        self.softmax_scale = softmax_scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """``q``/``k`` ``[B, heads or kv_heads, S_local, D]``, ``v`` ``[B, kv_heads, S_local, Dv]``."""
        return context_parallel_attention(q, k, v, self.group, self.cp_comm_type, self.softmax_scale)

    def extra_repr(self) -> str:
        return f"cp_comm_type={self.cp_comm_type!r}"


def context_parallel_positions(transformer: MoETransformer, local_len: int, device=None) -> Tensor | None:
    """The global positions of this CP rank's ``local_len`` tokens of each sequence (its two chunks).

    None when ``transformer`` was not made context parallel by :func:`apply_context_parallel`
    (positions ``0 .. local_len-1``). ``ValueError`` when the whole sequence (``CP x local_len``)
    exceeds the transformer's ``max_seq_len``.
    """
    layout = getattr(transformer, _CP_ATTR, None)
    if layout is None:
        return None
    cp_rank, cp_size = layout
    full = local_len * cp_size
    max_seq_len = transformer.config.max_seq_len
    if full > max_seq_len:
        raise ValueError(
            f"sequence length {full} (CP={cp_size} ranks x {local_len} tokens) exceeds "
            f"max_seq_len={max_seq_len}; shorten the sequences or raise max_seq_len."
        )
    return load_balanced_positions(full, cp_rank, cp_size, device=device)


def _position_hook(module: nn.Module, args: tuple, kwargs: dict):
    tokens = args[0] if args else kwargs["tokens"]
    positions = context_parallel_positions(module, tokens.shape[1], tokens.device)  # checks the length
    if kwargs.get("position_ids") is None:
        kwargs["position_ids"] = positions
    return args, kwargs


def apply_context_parallel(model: nn.Module, ctx: ParallelContext, cp_comm_type: str = "p2p") -> nn.Module:
    """Make every reference transformer in ``model`` context parallel over ``ctx``'s ``cp`` group (module docstring).

    MoE layers outside a reference transformer need nothing (they route the tokens they are given);
    a model whose own attention would see only the local chunks is the caller's to refuse
    (``MoEStrategy`` does).
    """
    cp = ctx.size("cp")
    if cp == 1:
        return model
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"Unknown cp_comm_type {cp_comm_type!r}; choose one of {list(CP_COMM_TYPES)}.")
    transformers = [m for m in model.modules() if isinstance(m, MoETransformer)]
    group, rank = ctx.group("cp"), ctx.rank_in("cp")
    for transformer in transformers:
        for parent in list(transformer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is CoreAttention:
                    setattr(parent, name, ContextParallelCoreAttention(group, cp_comm_type, child.softmax_scale))
        setattr(transformer, _CP_ATTR, (rank, cp))
        transformer.register_forward_pre_hook(_position_hook, with_kwargs=True)
    return model


def shard_batch(batch, ctx: ParallelContext):
    """``batch`` with every tensor of at least 2 dimensions (``[B, S, ...]``) cut to this CP rank's chunks."""
    cp = ctx.size("cp")
    if cp == 1:
        return batch
    rank = ctx.rank_in("cp")
    if isinstance(batch, Tensor):
        return shard_sequence(batch, rank, cp, dim=1) if batch.dim() >= 2 else batch
    if isinstance(batch, (list, tuple)):
        return type(batch)(shard_batch(b, ctx) for b in batch)
    if isinstance(batch, dict):
        return {k: shard_batch(v, ctx) for k, v in batch.items()}
    return batch


def cp_token_mean(total: Tensor, count: Tensor, ctx: ParallelContext) -> Tensor:
    """A token mean over the whole sequence from this CP rank's token ``total`` and ``count``.

    Returns ``CP * total / count_all`` (``count_all`` summed over ``cp``): averaged over the CP ranks,
    as the gradient pre-scale does, it is the mean over every token of the sequence, counted once.
    """
    cp = ctx.size("cp")
    if cp == 1:
        return total / count.clamp(min=1)
    count_all = count.detach().clone()
    dist.all_reduce(count_all, group=ctx.group("cp"))
    return total * cp / count_all.clamp(min=1)
