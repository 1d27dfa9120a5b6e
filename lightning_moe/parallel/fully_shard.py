"""`apply_fully_shard`: sharded data parallelism (PyTorch FSDP2) on both meshes of a folded layout.

Run by :func:`~lightning_moe.parallel.parallelize` after tensor and expert parallelism, when the
sharding strategy is not ``"NO_SHARD"``. Parameters, gradients and optimizer state are then split
over the data-parallel ranks of their own mesh (docs/architecture.md §10):

* routed experts (each EP rank's local experts) over the expert-data-parallel group ``edp``, one
  ``fully_shard`` unit per MoE layer's experts, sharded on the hidden dimension H (neither the
  expert dimension, which EP splits, nor F, which ETP splits), so the global state-dict view stays
  one regular DTensor sharding;
* everything else over the dense data-parallel ranks ``dp`` x ``cp`` (:func:`dense_shard_mesh`:
  one flattened mesh dimension ``dp_cp`` when ``cp > 1``): one unit per module a model's plan
  lists in ``fsdp_units`` (:mod:`~lightning_moe.parallel.model_plan`; the reference model's
  blocks, embedding, final norm and head, and those of a pipeline stage,
  :class:`~lightning_moe.parallel.pipeline.split.StageModule`; modules that share a parameter,
  such as a tied embedding and head, form one unit), one per
  :class:`~lightning_moe.layers.MoELayer` outside them, and one per
  top-level module for what is left. Tensor-parallel DTensors get FSDP's 2-D ``(dp, tp)``
  (``(dp_cp, tp)``) sharding;
* the model itself last, as the one root of all these units (:mod:`~lightning_moe.parallel.fsdp_root`:
  it owns the streams, so every unit's all-gathers and reduce-scatters overlap the others'
  compute), on the dense mesh (a root's own parameters could only be dense ones; here it holds
  none). The units of a plan prefetch their neighbours' all-gathers in its order, experts included
  (:func:`~lightning_moe.parallel.fsdp_root.set_chain_prefetch`).

Gradients keep today's scaling: every unit sums (``set_force_sum_reduction_for_comms``: gloo has
no pre-multiplied sum) and divides by the dense data-parallel size ``DP * CP``, experts included
(they are reduced over EDP only, but each EP rank already summed the gradients of its whole EP
group's tokens through the all-to-all). Parameters that hold partial gradients on each
tensor-parallel rank (plain tensors inside MoE layers, which route each TP rank's own tokens,
such as the router and the shared expert) are summed over ``tp`` afterwards by
:class:`~lightning_moe.parallel.sharded_grad_sync.ShardedGradSync`.

``"SHARD_GRAD_OP"`` keeps each unit's parameters gathered from its forward to its backward
(``reshard_after_forward=False``: one all-gather per step); ``"FULL_SHARD"`` frees them after
the forward and gathers them again for the backward (``reshard_after_forward=True``). No unit
returns a view (:func:`~lightning_moe.parallel.fsdp_outputs.return_no_views`: an in-place op on
one would drop FSDP's pre-backward hook, and torch warns about it on every rank).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from lightning_moe.layers.moe import MoELayer
from lightning_moe.parallel.expert_parallel import expert_hidden_dim, expert_shard, record_fsdp_sharding
from lightning_moe.parallel.fsdp_outputs import return_no_views
from lightning_moe.parallel.fsdp_root import claim_units, set_chain_prefetch
from lightning_moe.parallel.layout.groups import ParallelContext
from lightning_moe.parallel.model_plan import planned_modules, resolve
from lightning_moe.parallel.sharded_init import enable_sharded_init
from lightning_moe.parallel.user_tensor_parallel import tp_replicated_names

__all__ = [
    "SHARDING_STRATEGIES",
    "apply_fully_shard",
    "check_fully_shard",
    "check_sharding_strategy",
    "dense_shard_mesh",
    "fully_sharded_modules",
    "record_tp_partial_params",
    "tp_partial_params",
]

SHARDING_STRATEGIES = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")
"""Lightning ``FSDPStrategy``'s names: replicated (bucketed all-reduce), sharded gradients and
optimizer state with parameters gathered once per step, or fully sharded."""

_TP_PARTIAL_ATTR = "_lightning_moe_tp_partial_names"

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def check_sharding_strategy(name: str) -> str:
    """``name`` if it is one of `SHARDING_STRATEGIES`, else ``ValueError`` listing them."""
    if name not in SHARDING_STRATEGIES:
        raise ValueError(
            f"Unknown sharding_strategy {name!r}; choose one of {', '.join(map(repr, SHARDING_STRATEGIES))} "
            "(Lightning's FSDPStrategy names)."
        )
    return name


def tp_partial_params(model: nn.Module) -> list[nn.Parameter]:
    """The sharded parameters of ``model`` whose gradients must still be summed over ``tp`` (module docstring).

    Looked up by name at each call: ``fully_shard`` and materialisation replace parameter objects.
    """
    names = getattr(model, _TP_PARTIAL_ATTR, ())
    return [p for n, p in model.named_parameters() if n in names]


def record_tp_partial_params(model: nn.Module, params) -> None:
    """Record ``params`` (parameters of ``model``) as TP-partial, under ``model``'s names, for
    :func:`tp_partial_params` (e.g. after sharding a part of ``model`` held in another container)."""
    ids = {id(p) for p in params}
    setattr(model, _TP_PARTIAL_ATTR, frozenset(n for n, p in model.named_parameters() if id(p) in ids))


def fully_sharded_modules(model: nn.Module) -> list[FSDPModule]:
    """Every ``fully_shard`` unit inside ``model``, outermost first."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def check_fully_shard(model: nn.Module, ctx: ParallelContext, sharding_strategy: str) -> None:
    """Raise ``ValueError`` if ``model`` cannot be sharded with ``sharding_strategy`` on ``ctx``.

    Called by :func:`~lightning_moe.parallel.parallelize` before it changes anything.
    """
    check_sharding_strategy(sharding_strategy)
    if sharding_strategy == "NO_SHARD":
        return
    own = [n for n, _ in model.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"{type(model).__name__} holds parameters of its own ({', '.join(own)}); with sharding, every "
            "parameter must live in a submodule whose forward runs (move them into one), or use "
            "sharding_strategy='NO_SHARD'."
        )
    edp = ctx.size("edp")
    # FSDP2 needs even shards on a nonzero dimension.
    for name, layer in ((n, m) for n, m in model.named_modules() if isinstance(m, MoELayer)):
        hidden = layer.config.hidden_size
        if edp > 1 and hidden % edp:
            raise ValueError(
                f"{name}: sharding the experts over the expert-data-parallel size EDP={edp} splits their "
                f"hidden size {hidden}, which EDP must divide. Choose EP/ETP so that EDP = world / "
                f"(PP * EP * ETP) divides {hidden}, or use sharding_strategy='NO_SHARD'."
            )


def dense_shard_mesh(ctx: ParallelContext) -> DeviceMesh:
    """The 1-D mesh the dense parameters are sharded over: ``dp``, or ``dp`` x ``cp`` flattened.

    Every CP rank computes the gradients of its own chunks of the sequences, so under context
    parallelism the dense gradients reduce over DP x CP, as ``GradSync`` does without sharding,
    and the shards split over those ranks too. FSDP2 shards plainly over a 1-D mesh (a 2-D one
    would be HSDP: replicated over its first dimension), so ``dp`` and ``cp`` become one dimension
    ``dp_cp`` of the dense mesh, whose ranks are the ``dp_cp`` group's in the same order (CP varies
    fastest). It stays a child of the dense mesh, so tensor-parallel DTensors still get FSDP's
    2-D ``(dp_cp, tp)`` sharding.
    """
    if ctx.size("cp") == 1:
        return ctx.dense_mesh["dp"]
    # Cached on the dense mesh: building the flattened dimension again (another sharded model on
    # the same context) creates no further process groups.
    return ctx.dense_mesh["dp", "cp"]._flatten("dp_cp")


def _tp_partial_names(model: nn.Module, ctx: ParallelContext) -> set[str]:
    """Names of the plain (not tensor-parallel) dense parameters: partial gradients per TP rank.

    Under folding every TP rank routes its own tokens, so the router, the shared expert and the
    per-head q/k norms each hold the gradient of this rank's slice of the sequence only. Not those
    of a model's own tensor parallelism that every TP rank computes whole
    (:func:`~lightning_moe.parallel.user_tensor_parallel.tp_replicated_names`).
    """
    if ctx.size("tp") == 1:
        return set()
    replicated = tp_replicated_names(model)
    return {
        name for name, p in model.named_parameters()
        if not isinstance(p, DTensor) and expert_shard(p) is None and name not in replicated
    }


def _shard_experts(layer: MoELayer, mesh: DeviceMesh, divide: float, **kwargs) -> None:
    experts = layer.experts
    fully_shard(return_no_views(experts), mesh=mesh, shard_placement_fn=lambda p: Shard(expert_hidden_dim(expert_shard(p))), **kwargs)
    record_fsdp_sharding(experts)
    _sum_then_divide(experts, divide, mesh.size())


def _sum_then_divide(module: FSDPModule, divide: float, mesh_size: int) -> None:
    """Reduce ``module``'s gradients by a sum divided by ``divide`` (the dense data-parallel size)."""
    # gloo has no pre-multiplied sum: sum, then divide. On a mesh of one rank torch skips the
    # collective and divides once itself, and would divide a second time in the forced-sum path
    # (torch 2.13 _fsdp_collectives.foreach_reduce), so that case keeps the default path.
    module.set_force_sum_reduction_for_comms(mesh_size > 1)
    module.set_gradient_divide_factor(divide)
    # An expert that received no token on one rank still joins the reduce-scatter (with zeros).
    module.set_reduce_scatter_unused_params(True, recurse=False)


def _chains(model: nn.Module) -> list[list[nn.Module]]:
    """The ``fsdp_units`` of every planned module of ``model`` (outermost only), in forward order
    (pieces a pipeline trim set to None left out)."""
    chains = []
    for _, module, plan in planned_modules(model):
        units = [unit for unit in (resolve(module, name) for name in plan.fsdp_units) if unit is not None]
        if units:
            chains.append(units)
    return chains


def _grouped(pieces: list[nn.Module]) -> list[list[nn.Module]]:
    """``pieces`` in groups that share no parameter with another group (a tied embedding and head
    must be one unit: FSDP2 shards a parameter in one unit only)."""
    groups: list[tuple[list[nn.Module], set[int]]] = []
    for piece in pieces:
        ids = {id(p) for p in piece.parameters()}
        joined = [g for g in groups if g[1] & ids]
        merged = ([m for g in joined for m in g[0]] + [piece], ids.union(*(g[1] for g in joined)))
        groups = [g for g in groups if not any(g is j for j in joined)] + [merged]
    return [modules for modules, _ in groups]


def _top_level_units(model: nn.Module, sharded: set[int]) -> list[nn.Module]:
    """Top-level modules that still hold parameters no unit covers (containers are looked into)."""

    def has_rest(module: nn.Module) -> bool:
        return any(id(p) not in sharded for p in module.parameters())

    units: list[nn.Module] = []
    for child in model.children():
        if not has_rest(child):
            continue
        units.extend(_top_level_units(child, sharded) if isinstance(child, _CONTAINERS) else [child])
    return units


def apply_fully_shard(
    model: nn.Module,
    ctx: ParallelContext,
    sharding_strategy: str,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> list[FSDPModule]:
    """Shard ``model`` (already tensor- and expert-parallel) with FSDP2; return its units, ``model`` (the root) first.

    Args:
        model: the parallelized model, or one pipeline stage of it; meta-device parameters stay
            meta until materialised.
        ctx: the layout.
        sharding_strategy: ``"SHARD_GRAD_OP"`` or ``"FULL_SHARD"`` (``"NO_SHARD"`` is a no-op).
        mp_policy: FSDP2's mixed precision (e.g. bf16 compute, fp32 reduction), None for none.
    """
    check_fully_shard(model, ctx, sharding_strategy)
    if sharding_strategy == "NO_SHARD":
        return []
    enable_sharded_init()  # every layer's reset_parameters() then writes into its DTensor slices
    dense_mesh = dense_shard_mesh(ctx)
    divide = float(ctx.size("dp_cp"))
    kwargs = {"reshard_after_forward": sharding_strategy == "FULL_SHARD"}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    moe_layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    tp_partial = _tp_partial_names(model, ctx)
    for layer in moe_layers:
        _shard_experts(layer, ctx.expert_mesh["edp"], divide, **kwargs)
    sharded: set[int] = {id(p) for layer in moe_layers for p in layer.experts.parameters()}

    def shard(modules: list[nn.Module]) -> FSDPModule:
        for module in modules:
            return_no_views(module)
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=dense_mesh, **kwargs)
        sharded.update(id(p) for m in modules for p in m.parameters())
        _sum_then_divide(modules[0], divide, dense_mesh.size())
        return modules[0]

    chains = []
    for modules in _chains(model):
        units = {}
        for group in _grouped(modules):
            unit = shard(group)
            units.update((id(m), unit) for m in group)
        chains.append([units[id(m)] for m in modules])
    for layer in moe_layers:  # MoE layers outside every declared unit
        if any(id(p) not in sharded for p in layer.parameters()):
            shard([layer])
    for unit in _top_level_units(model, sharded):
        shard([unit])
    fully_shard(return_no_views(model), mesh=dense_mesh, **kwargs)  # the root: last, around every unit
    _sum_then_divide(model, divide, dense_mesh.size())
    claim_units(model)
    for chain in chains:
        set_chain_prefetch(chain)
    setattr(model, _TP_PARTIAL_ATTR, frozenset(tp_partial))
    return fully_sharded_modules(model)
