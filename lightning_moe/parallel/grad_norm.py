"""Global gradient norm and clipping over dense and expert shards, without double counting.

After gradient synchronisation every rank of a data-parallel group holds the same reduced
gradients (or, under sharded data parallelism, its own slice of them), so each distinct gradient
element is counted exactly once by summing each parameter's local squares over the groups that
shard it, and nowhere else:

* plain dense parameters are replicated on every rank: their squares are summed locally;
* DTensor parameters: over every mesh dimension with a ``Shard`` placement (``tp`` for tensor
  parallelism; ``dp``, or ``dp`` and ``tp``, for FSDP2's shards; ``dp_cp`` in place of ``dp``
  under context parallelism, where FSDP2 shards over the flattened DP x CP ranks);
* expert parameters are sharded over ETP x EP: over ``etp_ep``, and over ``edp`` as well when
  FSDP2 shards them there.

Per-mesh sums are combined into one norm: a plain ``clip_grad_norm_`` over parameters of two meshes
fails in torch. Pipeline stages hold distinct parameters: the per-stage totals are summed over ``pp``
(a model whose stages shared a parameter, e.g. tied embeddings, is refused when it is split).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_moe.compat import is_strided_shard
from lightning_moe.parallel.expert_parallel import expert_shard, is_expert_param
from lightning_moe.parallel.layout.groups import ParallelContext
from lightning_moe.parallel.layout.lightning_mesh import layout_dim_names

__all__ = ["clip_grad_norm_", "global_grad_norm"]


_KEYS = (
    (), ("tp",), ("etp_ep",), ("dp",), ("dp", "tp"), ("dp_cp",), ("dp_cp", "tp"), ("edp", "etp_ep"), ("ep",),
    ("edp", "ep"),
)
"""Every combination of groups a gradient can be sharded over, in the order all ranks reduce them."""
_ALWAYS = _KEYS[:3]
"""Reduced even when no parameter here needs them: a rank without gradients still takes part."""


def _shard_groups(param: Tensor) -> tuple[str, ...]:
    """The groups whose ranks hold distinct pieces of ``param`` (see the module docstring)."""
    names: tuple[str, ...] = ()
    if isinstance(param, DTensor):
        # A model's own tensor parallelism uses Lightning's dim names ("tensor_parallel").
        dims = layout_dim_names(param.device_mesh.mesh_dim_names)
        # FSDP2 shards a tensor-parallel dimension-0 shard again with a strided placement.
        names = tuple(
            dims[i] for i, placement in enumerate(param.placements)
            if placement.is_shard() or is_strided_shard(placement)
        )
    if is_expert_param(param):
        # A tensor every ETP rank holds whole (an adapter factor) is counted once per ETP group.
        names = (*names, "ep" if expert_shard(param).etp_replicas > 1 else "etp_ep")
    return names


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
    sums: dict[tuple[str, ...], Tensor] = {}
    for p in params:
        if p.grad is None:
            continue
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        key = _shard_groups(p)
        if key not in _KEYS:
            raise RuntimeError(f"gradient sharded over {key}, which the global norm does not know how to combine")
        sq = grad.detach().float().pow(2).sum()
        sums[key] = sums[key] + sq if key in sums else sq
    device = next(iter(sums.values())).device if sums else _device_of(params, ctx)
    total = torch.zeros((), dtype=torch.float32, device=device)
    # The sharded layouts come from the model's structure, the same on every rank; a rank without
    # such gradients still takes part, with zeros, to keep the collectives matched.
    present = {_shard_groups(p) for p in params}
    for key in (k for k in _KEYS if k in _ALWAYS or k in present):
        value = sums.get(key, torch.zeros((), dtype=torch.float32, device=device))
        for name in key:
            if ctx.size(name) > 1:
                dist.all_reduce(value, group=ctx.group(name))
        total = total + value
    if ctx.size("pp") > 1:
        dist.all_reduce(total, group=ctx.group("pp"))
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
