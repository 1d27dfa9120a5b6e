"""How `MoEStrategy` prepares a model written for one device: checks, identical start, materialisation.

No Lightning here: plain functions over the module and the default process group.

Every collective here runs on tensors that already live on the rank's device: an NCCL process
group has no CPU backend ("No backend type associated with device type cpu"), so a model that
``configure_model`` or ``__init__`` left on the CPU is moved to the device first
(:func:`prepare_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from lightning_moe.parallel.context_parallel.apply import context_parallel_problem
from lightning_moe.parallel.cpu_gemm_agreement import agree_on_cpu_gemm
from lightning_moe.parallel.expert_parallel import is_expert_param
from lightning_moe.parallel.expert_support import expert_parallel_support_problem
from lightning_moe.parallel.fully_shard import (
    apply_fully_shard,
    check_fully_shard,
    record_tp_partial_params,
    tp_partial_params,
)
from lightning_moe.parallel.layout.dims import ParallelDims
from lightning_moe.parallel.layout.groups import ParallelContext
from lightning_moe.parallel.options import ParallelOptions
from lightning_moe.parallel.parallelize import parallelize
from lightning_moe.parallel.user_tensor_parallel import broadcast_dtensor_replicas

__all__ = [
    "broadcast_initial_state", "check_context_parallel_support", "check_expert_parallel_support", "materialize",
    "move_materialized", "prepare_model", "prepare_model_once", "shard_split_model",
]

Split = Callable[[nn.Module], Sequence[nn.Module]]
"""Pipeline parallelism's hook: trims the model to this rank's stages, returns the stage modules (each sharded
as one FSDP2 root)."""

_LAYOUT_ATTR = "_lightning_moe_layout"


def check_context_parallel_support(model: nn.Module, cp: int) -> None:
    """Raise ``ValueError`` at CP > 1 unless ``model`` declares its attention for context parallelism.

    See :func:`~lightning_moe.parallel.context_parallel.apply.context_parallel_problem`.
    """
    problem = context_parallel_problem(model, cp)
    if problem is not None:
        raise ValueError(problem)


def check_expert_parallel_support(model: nn.Module, dims: ParallelDims) -> None:
    """Raise ``ValueError`` when the expert layout of ``dims`` would shard nothing of ``model``.

    See :func:`~lightning_moe.parallel.expert_support.expert_parallel_support_problem`.
    """
    problem = expert_parallel_support_problem(model, dims)
    if problem is not None:
        raise ValueError(problem)


def broadcast_initial_state(model: nn.Module) -> None:
    """Make every rank start from rank 0's model, as DDP does.

    Replicated parameters must agree across ranks, and expert shards are cut from the same global
    tensors. Materialised models broadcast their tensors; meta-device models broadcast the seeds
    (``init_seed`` attributes) their weights will be drawn from. DTensors (a model's own tensor
    parallelism) are left to
    :func:`~lightning_moe.parallel.user_tensor_parallel.broadcast_dtensor_replicas`.
    """
    # Even with one process: the backend is then exercised exactly as at scale (device placement).
    if not dist.is_initialized():
        return
    seeded = [m for m in model.modules() if isinstance(getattr(m, "init_seed", None), int)]
    seeds = [[m.init_seed for m in seeded]]
    dist.broadcast_object_list(seeds, src=0)
    for module, seed in zip(seeded, seeds[0]):
        module.init_seed = seed
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if not tensor.is_meta and not isinstance(tensor, DTensor):
                dist.broadcast(tensor.data, src=0)


def move_materialized(model: nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer that has storage to ``device``; meta tensors stay meta.

    A plain ``model.to(device)`` fails on a partly meta-device model (meta tensors cannot be
    copied); those are given storage on ``device`` later, by :func:`materialize`.
    """
    model._apply(lambda tensor: tensor if tensor.is_meta else tensor.to(device))


def prepare_model(
    model: nn.Module, ctx: ParallelContext, device: torch.device, options: ParallelOptions, split: Split | None = None,
) -> dict[tuple[int, int], str]:
    """Move ``model`` to ``device``, start every rank from rank 0's state, then apply the layout.

    The order matters on accelerators: the broadcasts of :func:`broadcast_initial_state` and the
    tensor-parallel sharding of :func:`~lightning_moe.parallel.parallelize` (``distribute_tensor``
    scatters from rank 0) are collectives, which a device-only process group (NCCL) cannot run on
    CPU tensors. Meta-device tensors are left for :func:`materialize`. On CPU the expert
    kernels' GEMM library is then chosen on rank 0 for every rank; returns those choices (see
    :func:`~lightning_moe.parallel.cpu_gemm_agreement.agree_on_cpu_gemm`), empty elsewhere.
    ``options`` (dispatcher, sharding, mixed precision, CP exchange) go whole to
    :func:`~lightning_moe.parallel.parallelize`.

    ``split`` (pipeline parallelism) trims the model to this rank's stages between the layout and
    the sharding: the whole model is broadcast (a meta-device model only its seeds) and
    parallelized without sharding, then split, then materialised (only this rank's stages get
    storage; the reference model draws each weight from its global name, so the values are those
    of the whole model), and then only the stage modules ``split`` returns are sharded, each the
    root of its units (:func:`shard_split_model`): FSDP2 cannot drop parameters once sharded, and
    the stages never call the model's own ``forward``.
    """
    move_materialized(model, device)
    broadcast_initial_state(model)
    broadcast_dtensor_replicas(model, ctx)
    # The ranks of a TP group load the same batches (the strategy checks it every step).
    if split is None:
        parallelize(model, ctx, options=options, tp_replicated_input=True)
    else:
        check_fully_shard(model, ctx, options.sharding_strategy)  # before anything changes
        parallelize(model, ctx, options=replace(options, sharding_strategy="NO_SHARD", mp_policy=None),
                    tp_replicated_input=True)
        stages = split(model)
        # The ranks of one pipeline stage hold the same modules: replicated tensors agree within it.
        materialize(model, device, group=ctx.group("tp_dp_cp"))
        shard_split_model(model, stages, ctx, options.sharding_strategy, options.mp_policy)
    return agree_on_cpu_gemm(model) if device.type == "cpu" else {}


def shard_split_model(
    model: nn.Module, stages: Sequence[nn.Module], ctx: ParallelContext, sharding_strategy: str,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> None:
    """Shard ``stages`` (this rank's pipeline stage modules over the trimmed ``model``) with FSDP2.

    :func:`~lightning_moe.parallel.apply_fully_shard` runs on each stage: its blocks and pieces
    (embedding, norm, head) become units, and the stage module, which the schedule calls once per
    micro-batch, their root. The tensor-parallel-partial parameters it records are then recorded
    on ``model`` under the model's names, where
    :class:`~lightning_moe.parallel.sharded_grad_sync.ShardedGradSync` looks them up.
    """
    if sharding_strategy == "NO_SHARD":
        return
    partial = []
    for stage in stages:
        apply_fully_shard(stage, ctx, sharding_strategy, mp_policy)
        partial.extend(tp_partial_params(stage))
    record_tp_partial_params(model, partial)


def prepare_model_once(
    model: nn.Module, ctx: ParallelContext, device: torch.device, options: ParallelOptions, split: Split | None = None,
) -> dict[tuple[int, int], str]:
    """:func:`prepare_model` unless ``model`` already holds this layout (a second ``fit``).

    A model parallelized with another layout cannot be re-sharded in place: ``ValueError``.
    Returns the CPU GEMM choices of :func:`prepare_model` (empty when nothing was done).
    """
    check_context_parallel_support(model, ctx.size("cp"))
    check_expert_parallel_support(model, ctx.dims)
    layout = (ctx.dims, options.dispatcher, options.sharding_strategy)
    applied = getattr(model, _LAYOUT_ATTR, None)
    if applied == layout:
        return {}
    if applied is not None:

        def sizes(dims, name: str, sharding: str) -> str:
            return (f"TP={dims.tp}, CP={dims.cp}, DP={dims.dp}, PP={dims.pp}, EP={dims.ep}, ETP={dims.etp}, "
                    f"dispatcher={name}, sharding_strategy={sharding}")

        raise ValueError(
            f"This LightningModule was already parallelized with {sizes(*applied)} and cannot be "
            f"re-sharded in place to {sizes(*layout)}. Save a checkpoint and load it into a fresh "
            "module instead (checkpoints reshard across layouts)."
        )
    choices = prepare_model(model, ctx, device, options, split)
    setattr(model, _LAYOUT_ATTR, layout)
    return choices


def _seeded(module: nn.Module) -> bool:
    """Whether ``module`` re-draws its whole subtree from its own ``init_seed`` in ``reset_parameters()``
    (the reference transformer and every MoE layer), the same on every rank."""
    return isinstance(getattr(module, "init_seed", None), int) and callable(getattr(module, "reset_parameters", None))


def _reset_roots(model: nn.Module, meta: set[tuple[str, str]]) -> list[tuple[str, nn.Module]]:
    """The modules whose ``reset_parameters()`` re-draws the meta tensors, outermost first: the reference
    transformer and MoE layers holding any (they draw their whole subtree from their seeds), else
    each module owning one directly."""
    owners = {name for name, _ in meta}
    roots, covered = [], []
    for name, module in model.named_modules():
        if any(name == c or name.startswith(c + ".") for c in covered):
            continue
        inside = any(not name or o == name or o.startswith(name + ".") for o in owners)
        if _seeded(module) and inside:
            roots.append((name, module))
            covered.append(name)
        elif name in owners and callable(getattr(module, "reset_parameters", None)):
            roots.append((name, module))
    return roots


def _subtree_tensors(module: nn.Module, prefix: str, whole: bool) -> dict[tuple[str, str], Tensor]:
    """``module``'s parameters and buffers (its subtree's when ``whole``), by (module name, tensor name)."""
    found = {}
    children = module.named_modules(prefix=prefix, remove_duplicate=False) if whole else [(prefix, module)]
    for name, sub in children:
        for kind in (sub._parameters, sub._buffers):
            for key, tensor in kind.items():
                if tensor is not None:
                    found[(name, key)] = tensor
    return found


def materialize(model: nn.Module, device: torch.device, group=None) -> None:
    """Give the meta-device parameters and buffers of ``model`` storage on ``device`` and initialise them.

    Only tensors on the meta device change: everything that already has storage (weights loaded
    or built on a device, torchmetrics states and their reset values, which ``Module.to_empty``
    would replace by uninitialised memory) keeps its values. The reference transformer and MoE
    layers re-draw every weight of their subtree from their seeds (experts from their global
    index, the same on every rank: nothing of theirs is sent); other modules owning a meta tensor
    use their own ``reset_parameters()``, which draws from each rank's own RNG, so those replicated
    tensors are then broadcast from the first rank of ``group`` (None: the default group; a pipeline stage's ranks under PP, whose
    models hold different modules). A tensor that had storage inside a re-initialised module gets
    its values back afterwards.
    """
    # (module name, tensor name) of every parameter and buffer still on the meta device.
    meta = {key for key, tensor in _subtree_tensors(model, "", True).items() if tensor.is_meta}
    if not meta:
        return
    roots = _reset_roots(model, meta)
    kept = {}
    for name, module in roots:
        whole = _seeded(module)
        kept.update({k: t.detach().clone() for k, t in _subtree_tensors(module, name, whole).items()
                     if k not in meta and not t.is_meta})
    # Module._apply, as to_empty, but the identity on tensors with storage (torchmetrics applies it to its states).
    model._apply(lambda tensor: torch.empty_like(tensor, device=device) if tensor.is_meta else tensor)
    for _, module in roots:
        module.reset_parameters()
    modules = dict(model.named_modules(remove_duplicate=False))
    with torch.no_grad():
        for (name, key), value in kept.items():
            owner = modules[name]
            (owner._parameters.get(key) if key in owner._parameters else owner._buffers[key]).copy_(value)
    if dist.is_initialized():
        source = 0 if group is None else dist.get_global_rank(group, 0)
        # Drawn from seeds every rank holds alike: the same values everywhere, nothing to send.
        seeded = {k for name, module in roots if _seeded(module)
                  for k in _subtree_tensors(module, name, True)}
        drawn = {id(t): t for k, t in _subtree_tensors(model, "", True).items() if k in meta and k not in seeded}
        with torch.no_grad():
            for tensor in drawn.values():
                # Expert shards differ per rank and DTensors were drawn from seeds: leave both.
                if not is_expert_param(tensor) and not isinstance(tensor, DTensor):
                    dist.broadcast(tensor.data, src=source, group=group)
