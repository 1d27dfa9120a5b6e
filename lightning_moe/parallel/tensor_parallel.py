"""`apply_tensor_parallel`: tensor + sequence parallelism of every model that declares how it shards.

A model declares its tensor-parallel plan in ``parallel_plan().tensor_parallel``
(:class:`~lightning_moe.parallel.model_plan.TensorParallelPlan`): a function that shards it over
the dense mesh's ``tp`` dimension, usually with ``torch.distributed.tensor.parallel``'s
``parallelize_module``, and the sizes it cannot shard. The reference model's plan (Megatron-style
TP with sequence parallelism, vocabulary-parallel embedding and head, MLA) is in
``lightning_moe/models/parallel_plan.py``. This module holds what any plan can use:

* :func:`shard_moe_input`: every MoE layer receives this rank's *local* sequence slice, so the
  ranks of a TP group route distinct tokens, which is what MoE parallel folding expects (experts
  live on EP, not TP);
* :class:`ReplicateParallel`: parameters replicated as DTensors, their gradients ``Partial`` over
  TP (Megatron's duplicated layers, MLA's down projections);
* :class:`GatheredNormParallel`: a norm over a head-sharded feature dimension.

Parameters sharded or replicated by these styles become DTensors; the gradient synchroniser
then reduces them over DP x CP only (DTensor already reduces over TP). Parameters left plain (the
MoE layers' router and shared expert, which see only local tokens) hold partial gradients and are
summed over TP x DP x CP.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_moe.layers.moe import MoELayer
from lightning_moe.parallel.layout.groups import ParallelContext
from lightning_moe.parallel.model_plan import planned_modules
from lightning_moe.parallel.sharded_init import enable_sharded_init

__all__ = [
    "GatheredNormParallel",
    "ReplicateParallel",
    "apply_tensor_parallel",
    "place_linear_adapters",
    "shard_moe_input",
    "tensor_parallel_problems",
]


def shard_moe_input(layer: MoELayer, tp_mesh: DeviceMesh) -> None:
    """Feed ``layer`` this rank's sequence slice as local tensors; return its output sequence-sharded.

    The input arrives as a DTensor sharded on the sequence (dim 1); the padding mask ``[B, S]``, if
    any, is cut to the same slice. Sequences must divide by the TP size (as with Megatron's
    sequence parallelism).
    """
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()

    def to_local(module: nn.Module, args: tuple) -> tuple:
        hidden, *rest = args
        if isinstance(hidden, DTensor):
            if hidden.shape[1] % tp:
                raise ValueError(
                    f"Sequence length {hidden.shape[1]} is not divisible by the tensor parallel size {tp}; "
                    "sequence parallelism needs equal slices: pad or choose the sequence length accordingly."
                )
            hidden = hidden.redistribute(placements=(Shard(1),)).to_local()
        mask = rest[0] if rest else None
        if mask is not None and mask.shape[1] != hidden.shape[1]:
            mask = mask.chunk(tp, dim=1)[rank]
        return (hidden, mask) if rest else (hidden,)

    def to_sequence_sharded(module: nn.Module, args: tuple, output: Tensor) -> DTensor:
        return DTensor.from_local(output, tp_mesh, (Shard(1),), run_check=False)

    layer.register_forward_pre_hook(to_local)
    layer.register_forward_hook(to_sequence_sharded)


class ReplicateParallel(ParallelStyle):
    """Replicate a module's parameters as DTensors over the TP mesh; its inputs are DTensors already.

    Its outputs stay replicated DTensors and, since each TP rank back-propagates only the heads it
    holds, its parameters' gradients come out ``Partial``: the gradient synchroniser sums them
    over TP (MLA's down projections and latent norms, Megatron's duplicated layers).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)  # the default partition_fn replicates


class GatheredNormParallel(ParallelStyle):
    """A norm over a head-sharded feature dimension (OLMoE's ``qk_norm='full'``): gather, normalise, re-shard.

    The input is this rank's local ``[B, S, width / TP]`` slice of a column-parallel projection;
    it is all-gathered on the last dimension, normalised with the replicated weight (every rank
    then computes the same complete weight gradient) and this rank's slice is returned as a local
    tensor. Costs one all-gather of the projection per use, forward and backward.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            x, *rest = inputs
            full = DTensor.from_local(x, mesh, (Shard(x.dim() - 1),), run_check=False)
            return (full.redistribute(placements=(Replicate(),)), *rest)

        def scatter(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> Tensor:
            return output.redistribute(placements=(Shard(output.dim() - 1),)).to_local()

        return distribute_module(module, device_mesh, input_fn=gather, output_fn=scatter)


def tensor_parallel_problems(model: nn.Module, tp: int) -> list[str]:
    """Every reason the plans inside ``model`` cannot shard it over ``tp`` ranks (their own checks)."""
    if tp == 1:
        return []
    problems: list[str] = []
    for _, _, plan in planned_modules(model):
        if plan.tensor_parallel is not None:
            problems.extend(p for p in plan.tensor_parallel.problems(tp) if p not in problems)
    return problems


def _replicated(param: DTensor) -> nn.Parameter:
    """``param`` as a DTensor replicated over its mesh (meta tensors stay meta, to be drawn later)."""
    if param.is_meta:
        value = DTensor.from_local(torch.empty(param.shape, device="meta"), param.device_mesh,
                                   [Replicate()] * param.device_mesh.ndim, run_check=False)
    else:
        value = param.detach().redistribute(param.device_mesh, [Replicate()] * param.device_mesh.ndim)
    return nn.Parameter(value, requires_grad=param.requires_grad)


def place_linear_adapters(model: nn.Module) -> None:
    """Lay out the LoRA adapters of tensor-parallel linear layers so that their product is exact and local.

    torch's column- and row-wise styles shard every parameter of a linear layer like its weight;
    for an adapter ``B @ A`` that would split the rank dimension of one factor. Instead: a
    column-parallel layer (weight ``Shard(0)``) keeps ``B`` ``[out, r]`` sharded on its output rows
    and replicates ``A``; a row-parallel one (weight ``Shard(1)``) replicates both, and
    ``LoRALinear`` gathers its input for the adapter (a partial ``[N, r]`` product would have to be
    reduced inside DTensor's backward, which cannot accumulate into a partial gradient). DTensor
    then reduces the replicated factors' gradients.
    """
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, DTensor) or not {"lora_A", "lora_B"} <= set(module._parameters):
            continue
        placement = weight.placements[0]
        if placement == Shard(0):
            module.lora_A = _replicated(module.lora_A)
        elif placement == Shard(1):
            module.lora_A = _replicated(module.lora_A)
            module.lora_B = _replicated(module.lora_B)


def apply_tensor_parallel(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    """Shard every module of ``model`` whose plan declares ``tensor_parallel`` over ``ctx``'s ``tp``
    dimension; no-op at TP=1. ``ValueError`` with the first of :func:`tensor_parallel_problems`."""
    tp = ctx.size("tp")
    if tp == 1:
        return model
    problems = tensor_parallel_problems(model, tp)
    if problems:
        raise ValueError(problems[0])
    enable_sharded_init()  # the sharded layers' reset_parameters() then writes into their DTensor slices
    tp_mesh = ctx.dense_mesh["tp"]
    for _, module, plan in planned_modules(model):
        if plan.tensor_parallel is not None:
            frozen = {name for name, param in module.named_parameters() if not param.requires_grad}
            plan.tensor_parallel.apply(tp_mesh)
            # torch's replicating partition function (sequence-parallel norms, ReplicateParallel) makes
            # new Parameters that require grad: a frozen one (a LoRA fine-tune's base) must stay frozen.
            for name, param in module.named_parameters():
                if name in frozen:
                    param.requires_grad_(False)
            place_linear_adapters(module)  # LoRA adapters of the linear layers the plan sharded
    return model
