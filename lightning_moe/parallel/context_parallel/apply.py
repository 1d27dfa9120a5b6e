"""`apply_context_parallel`: run a model on each CP rank's chunks of every sequence.

Applied by :func:`~lightning_moe.parallel.parallelize` when ``context_parallel_size > 1`` to every
module whose plan declares ``context_parallel`` (:mod:`~lightning_moe.parallel.model_plan`), first
(before tensor parallelism, whose sequence sharding then splits each rank's chunks further). The
caller feeds each CP rank its two chunks of every sequence (:func:`shard_batch`, chunks ``r`` and
``2C-1-r``, Megatron's causal load balance); the model then

* gives its position encoding the chunks' global positions (a forward pre-hook passing them in the
  keyword its plan names, ``position_ids`` for :class:`~lightning_moe.models.MoETransformer`;
  pipeline stages, which run the model's pieces without its ``forward``, ask
  :func:`context_parallel_positions`);
* attends over the whole sequence: every core-attention module its plan declares (the reference
  model's ``CoreAttention``, standard attention and MLA) becomes a
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

from lightning_moe.parallel.context_parallel.exchange import (
    CP_COMM_TYPES,
    context_parallel_attention,
    load_balanced_positions,
    shard_sequence,
)
from lightning_moe.parallel.layout.groups import ParallelContext
from lightning_moe.parallel.model_plan import ContextParallelPlan, planned_modules, resolve

__all__ = [
    "ContextParallelCoreAttention", "apply_context_parallel", "context_parallel_positions", "context_parallel_problem",
    "cp_token_mean",
    "shard_batch",
]

_CP_ATTR = "_lightning_moe_context_parallel"  # (cp rank, cp size, max_seq_len) on a model made context parallel


class ContextParallelCoreAttention(nn.Module):
    """Drop-in for a model's core attention (causal, ``[B, heads, S, D]``) on one CP rank's chunks.

    Args:
        group: the CP process group.
        cp_comm_type: ``"p2p"`` (ring) or ``"all_gather"``.
        softmax_scale: the replaced module's scale (None: ``D ** -0.5``).
        sliding_window: the replaced module's sliding window (None: full causal attention).
    """

    def __init__(
        self, group, cp_comm_type: str = "p2p", softmax_scale: float | None = None, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        if cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"Unknown cp_comm_type {cp_comm_type!r}; choose one of {list(CP_COMM_TYPES)}.")
        self.group = group
        self.cp_comm_type = cp_comm_type
        self.softmax_scale = softmax_scale
        self.sliding_window = sliding_window

    def forward(self, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None = None) -> Tensor:
        """``q``/``k`` ``[B, heads or kv_heads, S_local, D]``, ``v`` ``[B, kv_heads, S_local, Dv]``, ``sinks`` ``[heads]``."""
        return context_parallel_attention(
            q, k, v, self.group, self.cp_comm_type, self.softmax_scale, sinks=sinks, window=self.sliding_window
        )

    def extra_repr(self) -> str:
        window = "" if self.sliding_window is None else f", sliding_window={self.sliding_window}"
        return f"cp_comm_type={self.cp_comm_type!r}{window}"


def context_parallel_positions(model: nn.Module, local_len: int, device=None) -> Tensor | None:
    """The global positions of this CP rank's ``local_len`` tokens of each sequence (its two chunks).

    None when ``model`` was not made context parallel by :func:`apply_context_parallel`
    (positions ``0 .. local_len-1``). ``ValueError`` when the whole sequence (``CP x local_len``)
    exceeds the ``max_seq_len`` of the model's plan.
    """
    layout = getattr(model, _CP_ATTR, None)
    if layout is None:
        return None
    cp_rank, cp_size, max_seq_len = layout
    full = local_len * cp_size
    if max_seq_len is not None and full > max_seq_len:
        raise ValueError(
            f"sequence length {full} (CP={cp_size} ranks x {local_len} tokens) exceeds "
            f"max_seq_len={max_seq_len}; shorten the sequences or raise max_seq_len."
        )
    return load_balanced_positions(full, cp_rank, cp_size, device=device)


def _first_tensor(args: tuple, kwargs: dict) -> Tensor:
    return next(v for v in (*args, *kwargs.values()) if isinstance(v, Tensor))


def _position_hook(keyword: str | None):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        inputs = _first_tensor(args, kwargs)  # [B, S_local, ...]
        positions = context_parallel_positions(module, inputs.shape[1], inputs.device)  # checks the length
        if keyword is not None and kwargs.get(keyword) is None:
            kwargs[keyword] = positions
        return args, kwargs

    return hook


def _swap_attention(model: nn.Module, plan: ContextParallelPlan, group, cp_comm_type: str) -> None:
    for name in plan.attention:
        core = resolve(model, name)
        parent, _, attribute = name.rpartition(".")
        replacement = ContextParallelCoreAttention(
            group, cp_comm_type, getattr(core, "softmax_scale", None), getattr(core, "sliding_window", None)
        )
        setattr(resolve(model, parent), attribute, replacement)


def context_parallel_problem(model: nn.Module, cp: int) -> str | None:
    """Why ``cp`` > 1 cannot run ``model`` (None if it can): no module of it declares its attention.

    Context parallelism runs the attention a model's plan declares over the CP ranks' chunks of
    each sequence; any other attention would silently see the local chunks only.
    """
    if cp == 1 or any(plan.context_parallel is not None for _, _, plan in planned_modules(model)):
        return None
    return (
        f"context_parallel_size={cp} needs a model that declares its attention modules for context "
        f"parallelism (parallel_plan() with context_parallel, see lightning_moe.parallel.model_plan; "
        f"lightning_moe.models.MoETransformer does); {type(model).__name__} declares none. Declare them, "
        "or use context_parallel_size=1."
    )


def apply_context_parallel(model: nn.Module, ctx: ParallelContext, cp_comm_type: str = "p2p") -> nn.Module:
    """Make every module of ``model`` whose plan declares ``context_parallel`` context parallel over
    ``ctx``'s ``cp`` group (module docstring).

    MoE layers outside such a module need nothing (they route the tokens they are given); a
    model whose own attention would see only the local chunks is the caller's to refuse
    (:func:`context_parallel_problem`; ``MoEStrategy`` does).
    """
    cp = ctx.size("cp")
    if cp == 1:
        return model
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"Unknown cp_comm_type {cp_comm_type!r}; choose one of {list(CP_COMM_TYPES)}.")
    group, rank = ctx.group("cp"), ctx.rank_in("cp")
    for _, module, plan in planned_modules(model):
        if plan.context_parallel is None:
            continue
        _swap_attention(module, plan.context_parallel, group, cp_comm_type)
        setattr(module, _CP_ATTR, (rank, cp, plan.context_parallel.max_seq_len))
        module.register_forward_pre_hook(_position_hook(plan.context_parallel.position_kwarg), with_kwargs=True)
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
