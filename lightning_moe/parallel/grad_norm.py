"""Global gradient norm and clipping over dense and expert shards, without double counting.

After :class:`~lightning_moe.parallel.grad_sync.GradSync` every rank of a data-parallel group
holds the same reduced gradients, so each distinct gradient element is counted exactly once:

* plain dense parameters are replicated on every rank: their squares are summed locally;
* DTensor parameters sharded by tensor parallelism: local squares summed over ``tp``;
* expert parameters are sharded over ETP x EP (replicated over EDP): local squares summed over
  ``etp_ep``.

(Pipeline stages would add a sum over ``pp``; pipeline parallelism is not supported yet.)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from lightning_moe.parallel.context import ParallelContext
from lightning_moe.parallel.expert_parallel import is_expert_param

__all__ = ["clip_grad_norm_", "global_grad_norm"]


def _norm_group(param: Tensor) -> str | None:
    if is_expert_param(param):
        return "etp_ep"
    if isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements):
        return "tp"
    return None


def _device_of(params: list[Tensor], ctx: ParallelContext) -> torch.device:
    # A rank without gradients still joins the reductions, with zeros on the groups' device (an
    # NCCL group refuses CPU tensors).
    if params:
        return params[0].device
    if ctx.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(ctx.device_type)


def global_grad_norm(params: Iterable[Tensor], ctx: ParallelContext, norm_type: float = 2.0) -> Tensor:
    """The norm of the full gradient of the whole (unsharded) model, identical on every rank."""
    if norm_type != 2.0:
        raise ValueError(f"Only the 2-norm is supported across shards, got norm_type={norm_type}.")
    params = list(params)
    sums: dict[str | None, Tensor] = {}
    for p in params:
        if p.grad is None:
            continue
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        key = _norm_group(p)
        sq = grad.detach().float().pow(2).sum()
        sums[key] = sums[key] + sq if key in sums else sq
    device = next(iter(sums.values())).device if sums else _device_of(params, ctx)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for name in (None, "tp", "etp_ep"):
        value = sums.get(name, torch.zeros((), dtype=torch.float32, device=device))
        if name is not None and ctx.size(name) > 1:
            # Every rank takes part, with zeros if it has no such parameters, to keep collectives matched.
            dist.all_reduce(value, group=ctx.group(name))
        total = total + value
    return total.sqrt()


def clip_grad_norm_(
    params: Iterable[Tensor], max_norm: float, ctx: ParallelContext, norm: Tensor | None = None
) -> Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the norm before.

    ``norm``: the global norm of exactly these gradients when already known (not recomputed).
    """
    params = [p for p in params if p.grad is not None]
    if norm is None:
        norm = global_grad_norm(params, ctx)
    coeff = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coeff.to(p.grad.device))
    return norm
