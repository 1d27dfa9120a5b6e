"""`apply_expert_parallel`: shard every MoELayer's experts over EP (and ETP) and bind a dispatcher.

After it runs, each rank holds the experts ``[ep_rank * nle, (ep_rank + 1) * nle)`` of every MoE
layer, each cut to its expert-tensor-parallel block of the F dimension (fc1: its block of the gate
rows and its block of the up rows; fc2: its column block). The parameters stay plain local
tensors (fast kernels, any optimizer); the state dict still presents the public format of
docs/architecture.md §6 with *global* shapes:

* ``state_dict()`` wraps each expert tensor into a DTensor on the expert mesh whose local tensor
  is a view of the rank's shard: sharded over ``ep`` on the expert dimension and over ``etp`` on
  the F dimension (a gated fc1 in its checkpoint layout ``[E, 2, F, H]``, where a rank's gate
  block and up block are one plain shard on dimension 2: :mod:`lightning_moe.layers.expert_state`),
  over ``edp`` on H under sharded data parallelism, replicated otherwise. It never communicates
  and never copies, so any rank may call it alone;
* ``load_state_dict()`` accepts those DTensors (as filled by ``torch.distributed.checkpoint``), a
  DTensor of any other sharding, or a plain global tensor, in the checkpoint layout or in the
  older ``[E, 2F, H]`` of a gated fc1, and keeps this rank's slice.

So a checkpoint written at one EP/ETP size loads at another, and a single-file state dict of the
one-device model loads into a sharded one. Expert parameters are tagged (:func:`is_expert_param`)
so gradient synchronisation reduces them over the expert-data-parallel group instead of DP.

Under ETP ``fc2_bias`` is held whole by every ETP rank: only ETP rank 0 adds it to its partial fc2
output (``GroupedExperts.adds_fc2_bias``) and its gradient is summed over ETP where the experts use
it (``GroupedExperts.replicated_grad_sum``), so it is added once and every rank holds the
one-device gradient.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_moe.layers.activations import is_gated
from lightning_moe.layers.expert_state import fc1_checkpoint_shape, fc1_checkpoint_view, fc1_from_checkpoint
from lightning_moe.layers.moe import MoELayer
from lightning_moe.layers.router import RouterReduction
from lightning_moe.parallel.collectives import sum_grad
from lightning_moe.parallel.dispatchers import check_dispatcher, make_dispatcher
from lightning_moe.parallel.layout.check import expert_layer_problems
from lightning_moe.parallel.layout.groups import ParallelContext
from lightning_moe.parallel.sharded_init import enable_sharded_init

__all__ = [
    "ExpertShard", "ExpertStateConverter", "apply_expert_parallel", "contiguous_strides", "expert_hidden_dim",
    "expert_shard", "ffn_block_ranges", "is_expert_param", "record_fsdp_sharding",
]

_SHARD_ATTR = "_lightning_moe_expert_shard"


@dataclass(frozen=True)
class ExpertShard:
    """Where a local expert tensor sits in its global tensor; attached to expert parameters."""

    global_shape: tuple[int, ...]
    """Shape of the global tensor as stored (all experts, full F): the one-device parameter's."""
    expert_offset: int
    """Global index of the first local expert (dimension 0)."""
    ffn_dim: int | None
    """Dimension of the F axis (1 for fc1, 2 for fc2), None when not sharded over ETP (bias)."""
    ffn_rank: int
    """This rank's ETP block."""
    ffn_size: int
    """ETP size."""
    gated: bool
    """fc1 of a gated activation: the F axis is ``[gate ; up]``, each half sharded separately."""
    fsdp_dim: int | None = None
    """Dimension that sharded data parallelism (FSDP2) splits over ``edp``: the hidden dimension H
    (see :func:`expert_hidden_dim`), or None when the local experts are replicated over EDP."""
    hidden_dim: int | None = None
    """The dimension :func:`expert_hidden_dim` gives FSDP2 (None: derived from ``ffn_dim``)."""
    etp_replicas: int = 1
    """ETP ranks holding this same tensor, each computing a part of its gradient (an adapter factor
    that ETP does not cut): the module sums the parts over ``etp`` where it uses the tensor
    (``partial_grad_group``, :func:`~lightning_moe.parallel.collectives.sum_grad`)."""

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        """The global shape in the state dict: ``global_shape``, a gated fc1's as ``[E, 2, F, H]``."""
        return fc1_checkpoint_shape(self.global_shape) if self.gated else self.global_shape

    def checkpoint_dim(self, dim: int) -> int:
        """The state-dict dimension of the stored tensor's dimension ``dim`` (a gated fc1 gains the gate/up axis 1)."""
        return dim + 1 if self.gated and dim >= 1 else dim


def is_expert_param(param: Tensor) -> bool:
    """True for parameters sharded by :func:`apply_expert_parallel` (reduced over expert-DP)."""
    return hasattr(param, _SHARD_ATTR)


def expert_shard(param: Tensor) -> ExpertShard | None:
    """The :class:`ExpertShard` of an expert parameter, None for any other tensor."""
    return getattr(param, _SHARD_ATTR, None)


def expert_hidden_dim(shard: ExpertShard) -> int:
    """The H dimension of an expert tensor: fc1 ``[E, 2F, H]`` -> 2, fc2 ``[E, H, F]`` and bias ``[E, H]`` -> 1.

    Neither EP (dimension 0) nor ETP (the F dimension) splits it, so sharded data parallelism
    splits it over EDP and the global view stays one regular DTensor sharding.
    """
    if shard.hidden_dim is not None:
        return shard.hidden_dim
    return 2 if shard.ffn_dim == 1 else 1


def record_fsdp_sharding(experts: nn.Module) -> None:
    """After ``fully_shard`` split ``experts`` over EDP on H: note it in each parameter's shard description.

    ``fully_shard`` replaces the parameters, so the descriptions are attached again (through
    ``tag_parameter``, which keeps them across later conversions).
    """
    for name, tags in list(experts._param_tags.items()):
        spec = tags.get(_SHARD_ATTR)
        if spec is not None:
            experts.tag_parameter(name, _SHARD_ATTR, replace(spec, fsdp_dim=expert_hidden_dim(spec)))


def ffn_block_ranges(shard: ExpertShard, dim_len: int) -> list[tuple[int, int]]:
    """(start, stop) ranges of the global F axis that this rank holds, in local order."""
    if shard.gated:
        half = dim_len // 2
        step = half // shard.ffn_size
        return [(shard.ffn_rank * step, (shard.ffn_rank + 1) * step),
                (half + shard.ffn_rank * step, half + (shard.ffn_rank + 1) * step)]
    step = dim_len // shard.ffn_size
    return [(shard.ffn_rank * step, (shard.ffn_rank + 1) * step)]


def _local_slice(full: Tensor, shard: ExpertShard, num_local: int, experts_sliced: bool = False) -> Tensor:
    """This rank's block of a global tensor (or of a tensor already cut to the local experts)."""
    if not experts_sliced:
        full = full.narrow(0, shard.expert_offset, num_local)
    if shard.ffn_dim is None or shard.ffn_size == 1:
        return full
    pieces = [full.narrow(shard.ffn_dim, a, b - a) for a, b in ffn_block_ranges(shard, full.shape[shard.ffn_dim])]
    return torch.cat(pieces, dim=shard.ffn_dim) if len(pieces) > 1 else pieces[0]


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (computed, nothing allocated)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class ExpertStateConverter:
    """Converts expert tensors (parameters, optimizer moments) between local and global form.

    ``to_global`` gives the DTensor of the public state-dict format (module docstring), a view of
    the local tensor; ``to_local`` takes that DTensor, another DTensor, or a plain global tensor,
    and returns this rank's block. Used by the module's state-dict hooks and by sharded optimizer
    checkpoints. Neither communicates, except ``to_local`` of a DTensor of a foreign layout
    (another mesh or sharding), which is gathered whole first.
    """

    def __init__(self, ctx: ParallelContext) -> None:
        self.mesh = ctx.expert_mesh
        self.edp_mesh = ctx.expert_mesh["edp"]
        self.etp_size = ctx.size("etp")

    def placements(self, shard: ExpertShard) -> list:
        """DTensor placements of the state-dict tensor over the expert mesh ``(pp, edp, ep, etp)``."""
        edp = Replicate() if shard.fsdp_dim is None else Shard(shard.checkpoint_dim(shard.fsdp_dim))
        if shard.ffn_dim is None or self.etp_size == 1:
            return [Replicate(), edp, Shard(0), Replicate()]
        return [Replicate(), edp, Shard(0), Shard(shard.checkpoint_dim(shard.ffn_dim))]

    def legacy_placements(self, shard: ExpertShard) -> list | None:
        """Placements of an older checkpoint's gated fc1 ``[E, 2F, H]`` as
        :mod:`~lightning_moe.checkpoint.legacy` reads it: this rank's experts with the whole
        F (a rank's ETP block is not one range of that layout), its H block under sharded data
        parallelism. None for the other tensors, whose layout did not change."""
        if not shard.gated:
            return None
        edp = Replicate() if shard.fsdp_dim is None else Shard(shard.fsdp_dim)
        return [Replicate(), edp, Shard(0), Replicate()]

    def to_global(self, local: Tensor, shard: ExpertShard) -> DTensor:
        """The global-shape DTensor whose shard on this rank is ``local`` (a view of it, no copy).

        ``local`` is the parameter's own value: a plain tensor, or under sharded data parallelism
        the FSDP2 DTensor over ``edp`` (its local piece is used); a gated fc1 stored as
        ``[n, 2f, h]`` or already viewed as ``[n, 2, f, h]``.
        """
        local = local.detach()
        if isinstance(local, DTensor):
            local = local.to_local()
        if shard.gated and local.dim() == 3:
            local = fc1_checkpoint_view(local)
        shape = shard.checkpoint_shape
        return DTensor.from_local(
            local, self.mesh, self.placements(shard), run_check=False, shape=torch.Size(shape),
            stride=contiguous_strides(shape),
        )

    def accepts(self, value: Tensor, shard: ExpertShard) -> bool:
        """Whether ``value`` has a global shape of ``shard``'s tensor: the state dict's, or the stored
        one (which is also an older checkpoint's gated fc1 ``[E, 2F, H]``)."""
        return tuple(value.shape) in (shard.checkpoint_shape, shard.global_shape)

    def to_local(self, value: Tensor, shard: ExpertShard, num_local: int, name: str = "tensor") -> Tensor:
        """This rank's block of ``value`` (a DTensor of any layout, or a plain global tensor).

        Under sharded data parallelism the block is returned as the parameter's FSDP2 DTensor over
        ``edp`` (what ``load_state_dict`` and the optimizer copy into it).
        """
        if isinstance(value, DTensor):
            shape, placements = tuple(value.shape), list(value.placements)
            if value.device_mesh == self.mesh and shape == shard.checkpoint_shape and placements == self.placements(shard):
                # Our own layout (e.g. filled in place by torch.distributed.checkpoint).
                local = fc1_from_checkpoint(value.to_local()) if shard.gated else value.to_local()
                return self._as_fsdp_shard(local, shard, num_local, sliced=True)
            legacy = self.legacy_placements(shard)
            if value.device_mesh == self.mesh and shape == shard.global_shape and placements == legacy:
                # An older checkpoint's gated fc1: the local experts with the full F, cut to this ETP block.
                local = _local_slice(value.to_local(), shard, num_local, experts_sliced=True)
                return self._as_fsdp_shard(local, shard, num_local, sliced=True)
            value = value.full_tensor()
        if not self.accepts(value, shard):
            older = f" or the older {shard.global_shape}" if shard.gated else ""
            raise ValueError(
                f"{name}: expected the global shape {shard.checkpoint_shape}{older} (all experts, full F), "
                f"got {tuple(value.shape)}."
            )
        if shard.gated:
            value = fc1_from_checkpoint(value)
        return self._as_fsdp_shard(_local_slice(value, shard, num_local), shard, num_local, sliced=False)

    def _as_fsdp_shard(self, block: Tensor, shard: ExpertShard, num_local: int, sliced: bool) -> Tensor:
        """``block`` (the local experts, or already their H block when ``sliced``) as the FSDP2 shard."""
        if shard.fsdp_dim is None:
            return block
        size, rank = self.edp_mesh.size(), self.edp_mesh.get_local_rank()
        full_shape = list(block.shape)
        if sliced:
            full_shape[shard.fsdp_dim] *= size
        else:
            step = block.shape[shard.fsdp_dim] // size
            block = block.narrow(shard.fsdp_dim, rank * step, step)
        return DTensor.from_local(
            block.contiguous(), self.edp_mesh, [Shard(shard.fsdp_dim)], run_check=False,
            shape=torch.Size(full_shape), stride=torch.empty(full_shape, device="meta").stride(),
        )


class _ExpertStateDictHooks:
    """State-dict hooks of one sharded `GroupedExperts`: global DTensors out, local blocks in."""

    def __init__(self, converter: ExpertStateConverter) -> None:
        self.converter = converter

    def _expert_entries(self, module: nn.Module, state_dict: dict, prefix: str):
        for name, param in module.named_parameters(recurse=False):
            shard = expert_shard(param)
            if shard is not None and prefix + name in state_dict:
                yield prefix + name, param, shard

    def save(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
        for key, _, shard in list(self._expert_entries(module, state_dict, prefix)):
            state_dict[key] = self.converter.to_global(state_dict[key], shard)

    def load(self, module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
        for key, param, shard in list(self._expert_entries(module, state_dict, prefix)):
            state_dict[key] = self.converter.to_local(state_dict[key], shard, param.shape[0], name=key)


def _group_sum(group):
    def reduce(tensor: Tensor) -> Tensor:
        dist.all_reduce(tensor, group=group)
        return tensor

    return reduce


def _router_reduction(ctx: ParallelContext) -> RouterReduction:
    return RouterReduction(
        sum_tp_cp=_group_sum(ctx.group("tp_cp")), tp_cp_size=ctx.size("tp_cp"),
        sum_tp_dp_cp=_group_sum(ctx.group("tp_dp_cp")), tp_dp_cp_size=ctx.size("tp_dp_cp"),
    )


def _check_layer(layer: MoELayer, ctx: ParallelContext) -> None:
    """Every reason a layer cannot be sharded on ``ctx``, raised before anything is changed."""
    problems = expert_layer_problems(layer.config, ctx.dims)
    if problems:
        raise ValueError(problems[0])
    experts = layer.experts
    if experts.expert_offset != 0 or experts.num_experts != layer.config.num_experts:
        raise RuntimeError("apply_expert_parallel was already applied to this MoELayer.")


def _shard_experts(layer: MoELayer, ctx: ParallelContext) -> None:
    config, experts = layer.config, layer.experts
    ep, etp = ctx.size("ep"), ctx.size("etp")
    nle = config.num_experts // ep
    gated = is_gated(config.activation)
    offset = ctx.rank_in("ep") * nle
    specs = {}
    for name, (ffn_dim, gated, hidden_dim) in experts.expert_tensors().items():
        shape = tuple(getattr(experts, name).shape)
        if ffn_dim is None:
            specs[name] = ExpertShard(shape, offset, None, 0, 1, False, hidden_dim=hidden_dim, etp_replicas=etp)
        else:
            specs[name] = ExpertShard(shape, offset, ffn_dim, ctx.rank_in("etp"), etp, gated, hidden_dim=hidden_dim)
    for name, spec in specs.items():
        full = getattr(experts, name)
        local = _local_slice(full.detach(), spec, nle).clone()
        setattr(experts, name, nn.Parameter(local, requires_grad=full.requires_grad))
        experts.tag_parameter(name, _SHARD_ATTR, spec)
    experts.num_experts, experts.expert_offset = nle, offset
    experts.ffn_hidden_size //= etp
    experts.ffn_shard = (ctx.rank_in("etp"), etp)
    # Tensors every ETP rank holds whole get a part of their gradient from each rank's F block: the
    # experts module sums them over this group where it uses them (a module attribute, unlike a
    # tensor hook on the parameter, survives materialisation and FSDP2's unsharded copies).
    experts.partial_grad_group = ctx.group("etp") if etp > 1 else None
    # fc2_bias is such a tensor, added to the output by one ETP rank only: the others' partial fc2
    # outputs are summed with its output, so adding it everywhere would count it ETP times. Its
    # gradient is whole on that rank and zero on the others; the sum gives every rank the whole.
    experts.adds_fc2_bias = ctx.rank_in("etp") == 0
    experts.replicated_grad_sum = functools.partial(sum_grad, group=ctx.group("etp")) if etp > 1 else None
    experts.sharded_state_dict = True  # these hooks present fc1 in either layout; the one-device ones stand aside
    hooks = _ExpertStateDictHooks(ExpertStateConverter(ctx))
    # Plain functions: torch tags public hooks with an attribute, which bound methods cannot take.
    experts.register_state_dict_post_hook(lambda *args: hooks.save(*args))
    experts.register_load_state_dict_pre_hook(lambda *args: hooks.load(*args))


def apply_expert_parallel(
    model: nn.Module, ctx: ParallelContext, dispatcher: str = "alltoall", flex_backend: str = "auto"
) -> nn.Module:
    """Shard the experts of every `MoELayer` in ``model`` over EP x ETP and bind ``dispatcher``.

    Also points each router's statistics at the right groups: aux-loss counts over TP x CP and
    global aux-loss / expert-bias counts over TP x DP x CP. Works on materialised models (the
    local slice of each expert tensor is kept) and on meta-device models (call
    ``MoELayer.reset_parameters()`` after ``to_empty``: each expert is drawn from its global
    index, so the weights equal the one-device model's). Returns ``model``, modified in place.

    ``dispatcher`` is ``alltoall``, ``allgather`` or ``flex``; ``flex_backend`` (``auto``,
    ``torch``, ``deepep``) picks the implementation of ``flex`` and is ignored by the others.
    Names, layout and backend are checked before anything is changed.
    """
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    check_dispatcher(dispatcher, flex_backend)
    for layer in layers:
        _check_layer(layer, ctx)
    # Built first, so that a backend that cannot run (DeepEP missing) leaves the model unchanged.
    dispatchers = [make_dispatcher(dispatcher, layer.config, ctx, flex_backend) for layer in layers]
    enable_sharded_init()  # the experts' reset_parameters() then writes into their DTensor slices
    for layer, bound in zip(layers, dispatchers):
        _shard_experts(layer, ctx)
        layer.router.reduction = _router_reduction(ctx)
        layer.dispatcher = bound
    return model
