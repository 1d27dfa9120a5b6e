"""Tensor parallelism a model applies itself, the Lightning way, around lightning_moe's MoE layers.

Under Lightning's ``ModelParallelStrategy`` a LightningModule shards its own dense layers in
``configure_model``::

    def configure_model(self):
        tp = self.device_mesh["tensor_parallel"]
        parallelize_module(self.net, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})

``MoEStrategy`` offers the same mesh names (:mod:`~lightning_moe.parallel.layout.lightning_mesh`), and
:func:`apply_user_tensor_parallel` (run by :func:`~lightning_moe.parallel.parallelize` after the
model's own ``configure_model``) makes the rest of the layout agree with such a model:

* between the model's own tensor-parallel layers every TP rank holds the same activations (the
  local outputs of ``RowwiseParallel`` are all-reduced), so a :class:`~lightning_moe.layers.MoELayer`
  there receives the same tokens on each TP rank. Routing them all on every rank would count them
  TP times in the expert, router and shared-expert gradients. :func:`split_moe_tokens` gives each
  TP rank its own slice of them instead (the sequence of ``[B, S, H]``, the tokens of ``[T, H]``),
  exactly as the reference model's sequence parallelism feeds its MoE layers, and all-gathers the
  output back (its backward takes each rank's slice of the replicated output gradient; the input's
  gradient is all-gathered, so it stays replicated). Routers, aux-loss statistics, the token
  dispatch over EP and ETP and the expert gradients then behave as under the reference model;
* a DTensor input (the model kept ``use_local_output=False``) is redistributed to that slice on
  its own mesh and the output returned as a DTensor sharded the same way, so DTensor arithmetic
  around it stays correct whatever the input's placement;
* plain parameters outside the MoE layers (an embedding, a norm, a head the model did not shard)
  see the replicated activations, so each TP rank holds their *whole* gradient: they are recorded
  (:func:`tp_replicated_params`) and gradient synchronisation reduces them over the data-parallel
  ranks only, not summed over TP as the MoE layers' plain parameters (partial per TP rank) are;
* DTensor parameters the model made keep their own handling: sharded ones are reduced over the
  data-parallel ranks, replicated ones over TP as their gradients' placements say, clipped by a
  DTensor-aware global norm, saved as global tensors, and sharded by FSDP2 on the data-parallel
  dims of the same mesh (2-D).

Models whose layout lightning_moe plans itself (the reference transformer) are passed as
``planned`` and left alone. A plain input that differs between the TP ranks (sequence-sharded
local tensors) is refused at the layer's first forward (one small all-gather of its fingerprint):
pass it as a DTensor instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_moe.layers.moe import MoELayer
from lightning_moe.parallel.expert_parallel import is_expert_param
from lightning_moe.parallel.layout.groups import ParallelContext
from lightning_moe.parallel.layout.lightning_mesh import layout_dim_names
from lightning_moe.parallel.sharded_init import enable_sharded_init

__all__ = [
    "apply_user_tensor_parallel",
    "broadcast_dtensor_replicas",
    "check_user_dtensors",
    "split_moe_tokens",
    "tp_replicated_names",
    "tp_replicated_params",
]

_REPLICATED_ATTR = "_lightning_moe_tp_replicated_names"
_SPLIT_ATTR = "_lightning_moe_tp_token_split"
_FINGERPRINT_RTOL = 1e-5
"""The TP ranks' copies of a replicated activation come from the same all-reduce (bitwise equal in
practice); sequence slices of one batch differ in their sums by far more than this."""


def tp_replicated_names(model: nn.Module) -> frozenset[str]:
    """Names of ``model``'s parameters whose gradient every TP rank holds whole (module docstring)."""
    return getattr(model, _REPLICATED_ATTR, frozenset())


def tp_replicated_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of :func:`tp_replicated_names`, looked up by name (materialisation and FSDP2 replace objects)."""
    names = tp_replicated_names(model)
    return [p for n, p in model.named_parameters() if n in names]


def _token_dim(hidden: Tensor) -> int:
    return 1 if hidden.dim() == 3 else 0


def _check_divisible(hidden: Tensor, tp: int, name: str) -> int:
    dim = _token_dim(hidden)
    if hidden.shape[dim] % tp:
        what = "sequence length" if dim == 1 else "number of tokens"
        raise ValueError(
            f"MoE layer {name!r}: the {what} {hidden.shape[dim]} of its input {tuple(hidden.shape)} is not divisible "
            f"by the tensor parallel size {tp}; each TP rank routes an equal slice: choose a multiple of {tp}."
        )
    return dim


def _check_same_on_tp_ranks(hidden: Tensor, tp_mesh: DeviceMesh, name: str) -> None:
    """Raise unless every TP rank holds the same plain ``hidden`` (shape, sum and sum of squares agree)."""
    values = hidden.detach().double()
    mine = torch.stack([torch.tensor(float(values.numel()), dtype=torch.float64, device=values.device),
                        values.sum(), values.square().sum()])
    every = [torch.empty_like(mine) for _ in range(tp_mesh.size())]
    dist.all_gather(every, mine, group=tp_mesh.get_group())
    if not all(torch.allclose(other, every[0], rtol=_FINGERPRINT_RTOL, atol=0.0) for other in every):
        raise ValueError(
            f"MoE layer {name!r} received different plain tensors on the {tp_mesh.size()} tensor-parallel ranks "
            f"(numel, sum, sum of squares per rank: {[e.tolist() for e in every]}). A plain input is taken as "
            "replicated over TP (what ColwiseParallel/RowwiseParallel's local outputs are); a sequence-sharded "
            "one must stay a DTensor (use_local_output=False in the style that produces it)."
        )


def split_moe_tokens(layer: MoELayer, tp_mesh: DeviceMesh, name: str = "") -> None:
    """Make ``layer`` route this TP rank's slice of its (TP-replicated) input and return the whole output.

    See the module docstring. The padding mask, if any, is cut to the same slice. Idempotent.
    """
    if getattr(layer, _SPLIT_ATTR, False):
        return
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    checked = []  # the first forward's check of a plain input, once per layer
    # The mesh of each running call's DTensor input (None: a local input), pushed by the pre-hook
    # and popped by the post-hook: a forward hook sees the sliced arguments only. Calls of one
    # layer nest (recompute re-runs a forward whole), so a stack pairs them.
    input_meshes: list[DeviceMesh | None] = []

    def to_slice(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, *rest = args
        dim = _check_divisible(hidden, tp, name)
        if isinstance(hidden, DTensor):
            if hidden.device_mesh.ndim != 1:
                raise ValueError(
                    f"MoE layer {name!r}: its DTensor input lives on the {hidden.device_mesh.ndim}-D mesh "
                    f"{hidden.device_mesh.mesh_dim_names}; give it a tensor-parallel (1-D) DTensor or a local tensor."
                )
            input_meshes.append(hidden.device_mesh)
            local = hidden.redistribute(placements=(Shard(dim),)).to_local()
        else:
            if not checked:
                _check_same_on_tp_ranks(hidden, tp_mesh, name)
                checked.append(True)
            input_meshes.append(None)
            # Backward: the slice's gradient all-gathered, so the input's gradient stays replicated.
            local = DTensor.from_local(hidden, tp_mesh, (Replicate(),), run_check=False).redistribute(
                placements=(Shard(dim),)).to_local()
        in_kwargs = "padding_mask" in kwargs
        mask = kwargs["padding_mask"] if in_kwargs else (rest[0] if rest else None)
        if mask is not None:
            mask = (mask.full_tensor() if isinstance(mask, DTensor) else mask).chunk(tp, dim=dim)[rank]
            if in_kwargs:
                kwargs = {**kwargs, "padding_mask": mask}
            else:
                rest = [mask, *rest[1:]]
        return (local, *rest), kwargs

    def to_whole(module: nn.Module, args: tuple, kwargs: dict, output: Tensor) -> Tensor:
        mesh = input_meshes.pop()
        dim = _token_dim(output)
        if mesh is not None:  # a DTensor input: its slice as a DTensor of the same mesh
            return DTensor.from_local(output, mesh, (Shard(dim),), run_check=False)
        # Backward: each rank's slice of the (replicated) output gradient.
        return DTensor.from_local(output, tp_mesh, (Shard(dim),), run_check=False).redistribute(
            placements=(Replicate(),)).to_local()

    layer.register_forward_pre_hook(to_slice, with_kwargs=True)
    layer.register_forward_hook(to_whole, with_kwargs=True)
    setattr(layer, _SPLIT_ATTR, True)


def _inside(name: str, roots: Sequence[str]) -> bool:
    return any(r == "" or name == r or name.startswith(r + ".") for r in roots)


def check_user_dtensors(model: nn.Module, ctx: ParallelContext, planned: Sequence[nn.Module] = ()) -> None:
    """Raise ``ValueError`` for what the model's own parallelism may not do under ``MoEStrategy``.

    Its DTensor parameters must live on the tensor-parallel dim alone (``device_mesh["tensor_parallel"]``):
    the data-parallel dims are the strategy's (``sharding_strategy`` applies FSDP2 there), so a model
    that called ``fully_shard`` itself is refused too, and so is a pipeline split of such a model.
    """
    planned_names = [n for n, m in model.named_modules() if any(m is p for p in planned)]
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError(
            f"{type(model).__name__} was sharded with fully_shard before MoEStrategy set it up; MoEStrategy "
            "applies FSDP2 itself over the data-parallel ranks: remove fully_shard from configure_model and pass "
            "MoEStrategy(sharding_strategy='FULL_SHARD') (or 'SHARD_GRAD_OP')."
        )
    own = [(n, t) for n, t in (*model.named_parameters(), *model.named_buffers())
           if isinstance(t, DTensor) and not _inside(n, planned_names)]
    for name, tensor in own:
        dims = layout_dim_names(tensor.device_mesh.mesh_dim_names)
        if dims != ("tp",):
            raise ValueError(
                f"{name} is a DTensor on the mesh dims {tensor.device_mesh.mesh_dim_names}; a model's own tensor "
                "parallelism under MoEStrategy uses self.device_mesh['tensor_parallel'] alone (the data-parallel "
                "dims are sharded by MoEStrategy(sharding_strategy=...))."
            )
    if own and ctx.size("pp") > 1:
        raise ValueError(
            f"pipeline_parallel_size={ctx.size('pp')} cannot split a model that made its own tensor-parallel "
            f"DTensors ({own[0][0]}, ...); use pipeline_parallel_size=1 with its tensor parallelism."
        )


def broadcast_dtensor_replicas(model: nn.Module, ctx: ParallelContext) -> None:
    """Give the data-parallel replicas of every tensor-parallel DTensor of ``model`` the first replica's values.

    What ``DDP`` does for plain tensors, for the model's own DTensors (see :func:`check_user_dtensors`):
    the ranks of one ``dp_cp`` group hold the same TP shard, so each local shard is broadcast from the
    group's first rank. Meta-device tensors are skipped.
    """
    if ctx.size("dp_cp") == 1:
        return
    group, source = ctx.group("dp_cp"), ctx.ranks("dp_cp")[0]
    seen: set[int] = set()
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            # Other meshes are refused by check_user_dtensors.
            if (isinstance(tensor, DTensor) and not tensor.is_meta and id(tensor) not in seen
                    and layout_dim_names(tensor.device_mesh.mesh_dim_names) == ("tp",)):
                seen.add(id(tensor))
                dist.broadcast(tensor.to_local(), src=source, group=group)


def apply_user_tensor_parallel(
    model: nn.Module, ctx: ParallelContext, planned: Sequence[nn.Module] = (), replicated_input: bool = False,
) -> nn.Module:
    """Fit ``model``'s MoE layers and plain parameters to the tensor parallelism it applied itself (module docstring).

    ``planned``: submodules whose tensor parallelism lightning_moe applied from its own plan (the
    reference transformer); their MoE layers and parameters are left alone. ``replicated_input``:
    the ranks of a TP group feed the model the same inputs (``MoEStrategy``), so even a model
    without tensor parallelism of its own computes replicated inputs for its MoE layers. Without
    either (a model of plain layers fed each rank's own tokens) nothing changes: each TP rank
    routes what it is given. A no-op at TP=1. Returns ``model``.
    """
    check_user_dtensors(model, ctx, planned)
    if ctx.size("tp") == 1:
        return model
    enable_sharded_init()  # layers the user's plan sharded write their initial values into DTensor slices
    planned_names = [n for n, m in model.named_modules() if any(m is p for p in planned)]
    own_tp = any(isinstance(p, DTensor) and not _inside(n, planned_names) for n, p in model.named_parameters())
    if not (replicated_input or own_tp):
        return model
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, MoELayer) and not _inside(n, planned_names)]
    # Every rank of a TP group holds the whole gradient of a plain parameter outside the MoE layers.
    in_layers = [n for n, _ in layers]
    replicated = {
        n for n, p in model.named_parameters()
        if not isinstance(p, DTensor) and not is_expert_param(p)
        and not _inside(n, planned_names) and not _inside(n, in_layers)
    }
    if ctx.size("pp") > 1 and (layers or replicated):
        # Pipeline stages are re-rooted modules: the records above would not follow them.
        raise ValueError(
            f"tensor_parallel_size={ctx.size('tp')} with pipeline_parallel_size={ctx.size('pp')} needs a model whose "
            f"parallel_plan() declares tensor_parallel (such as lightning_moe.models.MoETransformer); "
            f"{type(model).__name__} has layers outside one "
            f"({(in_layers or sorted(replicated))[0]}, ...). Use pipeline_parallel_size=1 or tensor_parallel_size=1."
        )
    for name, layer in layers:
        split_moe_tokens(layer, ctx.dense_mesh["tp"], name)
    setattr(model, _REPLICATED_ATTR, frozenset(replicated | tp_replicated_names(model)))
    return model
