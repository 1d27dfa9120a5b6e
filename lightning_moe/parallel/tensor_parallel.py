"""`apply_tensor_parallel`: Megatron-style tensor + sequence parallelism for the reference model.

Applied with ``torch.distributed.tensor.parallel`` on the dense mesh's ``tp`` dimension, to a
:class:`~lightning_moe.models.MoETransformer` built for one device:

* the token embedding is sharded over the vocabulary (Megatron's vocab-parallel embedding,
  :mod:`~lightning_moe.parallel.vocab_parallel_embedding`: each rank looks up and back-propagates
  only its ``V / TP`` rows) and emits a sequence-sharded output;
* norms run sequence parallel (each TP rank normalises its own slice of the sequence);
* attention and dense MLPs gather the sequence, shard heads / hidden units column-wise
  (q/k/v, gate/up) and row-wise (o, down), and scatter the result back over the sequence;
* multi-head latent attention (Megatron's MLA plan): the down projections and latent norms are
  replicated DTensors fed the gathered sequence (each TP rank back-propagates only its heads, so
  their gradients arrive ``Partial`` and are summed over TP), the up projections column-parallel
  over heads, ``o_proj`` row-parallel; the shared rotary key leaves the replicated part as a
  local tensor whose gradient is declared partial (``rope_key``);
* OLMoE's q/k norm over the whole projection (``qk_norm='full'``) gathers the head-sharded
  projection, normalises it with a replicated weight and hands each rank its heads back;
* every MoE layer receives this rank's *local* sequence slice: the ranks of a TP group route
  distinct tokens, which is what MoE parallel folding expects (experts live on EP, not TP);
* the output head is column-parallel over the vocabulary (it gathers the sequence, as Megatron's
  sequence parallelism does before the head) and its logits stay sharded: each TP rank holds
  ``[B, S, V / TP]`` of them, the model's loss is the vocabulary-parallel cross-entropy
  (:mod:`~lightning_moe.parallel.vocab_parallel_loss`, attached as ``model.vocab_parallel``) and
  only inference gathers them (``model.full_logits``).

Parameters sharded or replicated by these styles become DTensors; the gradient synchroniser
then reduces them over DP x CP only (DTensor already reduces over TP). Parameters left plain (the
MoE layers' router and shared expert, which see only local tokens) hold partial gradients and are
summed over TP x DP x CP. Requires the vocabulary, the head counts and the FFN width to divide by TP.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_moe.layers.moe import MoELayer
from lightning_moe.models.mla import MultiLatentAttention
from lightning_moe.parallel.context import ParallelContext
from lightning_moe.parallel.vocab_parallel_embedding import VocabParallelEmbedding
from lightning_moe.parallel.vocab_parallel_loss import VocabParallelLogits

__all__ = [
    "GatheredNormParallel",
    "ReplicateParallel",
    "apply_tensor_parallel",
    "place_linear_adapters",
    "shard_moe_input",
    "tensor_parallel_plan",
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


def _rope_key_to_local(module: nn.Module, args: tuple) -> tuple:
    """The shared rotary key as a local tensor, its gradient (from this rank's heads only) partial."""
    (k_rot,) = args
    if isinstance(k_rot, DTensor):
        k_rot = k_rot.to_local(grad_placements=(Partial(),))
    return (k_rot,)


def _check_divisible(model: nn.Module, tp: int) -> None:
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(
            f"apply_tensor_parallel needs a lightning_moe MoETransformer (with .config); got {type(model).__name__}."
        )
    kv_heads = config.num_kv_heads or config.num_attention_heads
    checks = {
        "vocab_size": config.vocab_size,
        "num_attention_heads": config.num_attention_heads,
        "num_kv_heads": kv_heads,
        "ffn_hidden_size": config.ffn_hidden_size,
    }
    if config.tie_embeddings:
        raise ValueError(
            f"tie_embeddings=True is not supported with tensor parallel size {tp} yet (the embedding and the "
            "output head are sharded separately); untie them or use TP=1."
        )
    # ffn_hidden_size is None in all-MoE models (no dense FFN layer to shard).
    bad = {name: value for name, value in checks.items() if value is not None and value % tp}
    if bad:
        raise ValueError(
            f"Tensor parallel size {tp} must divide {', '.join(f'{k}={v}' for k, v in bad.items())}; "
            "choose a TP size that divides them (pad the vocabulary to a multiple of TP)."
        )


def tensor_parallel_plan(model: nn.Module) -> dict[str, object]:
    """The parallelize_module plan of a MoETransformer, by submodule name."""
    plan: dict[str, object] = {
        # Its own style, not RowwiseParallel: see vocab_parallel_embedding (no [V, H] gradient per rank).
        "embed": VocabParallelEmbedding(output_layout=Shard(1)),
        "norm": SequenceParallel(),
        # Local [B, S, V / TP] logits: gathering them would hold B x S x V on every rank.
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1)),
    }
    for i, block in enumerate(model.layers):
        prefix = f"layers.{i}"
        plan[f"{prefix}.attn_norm"] = SequenceParallel()
        plan[f"{prefix}.ffn_norm"] = SequenceParallel()
        # Attention takes (x, cos, sin): gather the sequence of x, leave the rotary tables alone.
        plan[f"{prefix}.attn"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        )
        if isinstance(block.attn, MultiLatentAttention):
            plan.update(_mla_plan(f"{prefix}.attn", block.attn))
        else:
            for name in ("q_proj", "k_proj", "v_proj"):
                plan[f"{prefix}.attn.{name}"] = ColwiseParallel()
            if getattr(block.attn, "qk_norm", None) == "full":
                plan[f"{prefix}.attn.q_norm"] = GatheredNormParallel()
                plan[f"{prefix}.attn.k_norm"] = GatheredNormParallel()
        plan[f"{prefix}.attn.o_proj"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        if not isinstance(block.ffn, MoELayer):  # MoE layers: see shard_moe_input
            # The dense MLP takes (x, padding_mask): gather the sequence of x.
            plan[f"{prefix}.ffn"] = PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            )
            plan[f"{prefix}.ffn.gate_proj"] = ColwiseParallel()
            plan[f"{prefix}.ffn.up_proj"] = ColwiseParallel()
            plan[f"{prefix}.ffn.down_proj"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return plan


def _mla_plan(prefix: str, attention: MultiLatentAttention) -> dict[str, object]:
    """Down projections and latent norms replicated, up projections column-parallel (over heads)."""
    plan: dict[str, object] = {}
    if hasattr(attention, "q_proj"):
        plan[f"{prefix}.q_proj"] = ColwiseParallel()
    else:
        plan[f"{prefix}.q_down_proj"] = ReplicateParallel()
        plan[f"{prefix}.q_latent_norm"] = ReplicateParallel()
        plan[f"{prefix}.q_up_proj"] = ColwiseParallel()
    plan[f"{prefix}.kv_down_proj"] = ReplicateParallel()
    plan[f"{prefix}.kv_latent_norm"] = ReplicateParallel()
    plan[f"{prefix}.kv_up_proj"] = ColwiseParallel()
    return plan


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
    """Shard ``model`` (a MoETransformer) over the ``tp`` dimension of ``ctx``; no-op at TP=1."""
    tp = ctx.size("tp")
    if tp == 1:
        return model
    _check_divisible(model, tp)
    tp_mesh = ctx.dense_mesh["tp"]

    def check_sequence_length(module: nn.Module, args: tuple) -> None:
        if args[0].shape[1] % tp:
            raise ValueError(
                f"Sequence length {args[0].shape[1]} is not divisible by the tensor parallel size {tp}; "
                "sequence parallelism splits every sequence into equal slices: choose a multiple of TP."
            )

    model.register_forward_pre_hook(check_sequence_length)
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model))
    # torch's replicating partition function (sequence-parallel norms, ReplicateParallel) makes new
    # Parameters that require grad: a frozen one (a LoRA fine-tune's base) must stay frozen.
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    place_linear_adapters(model)
    model.vocab_parallel = VocabParallelLogits(tp_mesh, model.config.vocab_size)
    for block in model.layers:
        if isinstance(block.attn, MultiLatentAttention):
            block.attn.rope_key.register_forward_pre_hook(_rope_key_to_local)
    for block in model.layers:
        if isinstance(block.ffn, MoELayer):
            shard_moe_input(block.ffn, tp_mesh)
    return model
