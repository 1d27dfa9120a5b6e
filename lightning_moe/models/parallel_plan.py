"""How the reference :class:`~lightning_moe.models.MoETransformer` is parallelised: its `ModelPlan`.

Everything ``lightning_moe.parallel``, ``lightning_moe.memory`` and ``lightning_moe.graphs`` know
about this model, read top to bottom (:func:`transformer_plan`, returned by
``MoETransformer.parallel_plan()``; the protocol is :mod:`lightning_moe.parallel.model_plan`):

* **context parallelism**: every ``layers.{i}.attn.core_attn`` (:class:`CoreAttention`, in
  standard attention and MLA) attends over the CP ranks' chunks; the chunks' positions reach the
  rotary embedding through ``forward(..., position_ids=...)``, bounded by ``max_seq_len``;
* **pipeline parallelism**: blocks ``layers``, first piece ``embed``, last pieces ``norm`` and
  ``lm_head``; each stage computes the rotary tables itself (with the CP chunks' positions);
  tied embeddings cannot be split (the embedding and the head would share one weight on two ranks);
* **FSDP2 units**: the embedding, each block, the final norm and the head, in that (prefetch) order;
* **recompute**: ``layernorm`` the norms ``attn_norm`` / ``ffn_norm``, ``core_attn`` the
  :class:`CoreAttention` s, ``attention`` the :class:`Attention` and
  :class:`MultiLatentAttention` modules;
* **CUDA graphs**: every block (``TransformerBlock.attention_residual`` / ``ffn_residual``);
* **tensor parallelism** (Megatron-style, with sequence parallelism), on the dense mesh's ``tp``
  dimension:

  - the token embedding is sharded over the vocabulary (Megatron's vocab-parallel embedding,
    :mod:`~lightning_moe.parallel.vocab_parallel_embedding`: each rank looks up and
    back-propagates only its ``V / TP`` rows) and emits a sequence-sharded output;
  - norms run sequence parallel (each TP rank normalises its own slice of the sequence);
  - attention and dense MLPs gather the sequence, shard heads / hidden units column-wise
    (q/k/v, gate/up) and row-wise (o, down), and scatter the result back over the sequence; the
    q/k/v biases (``attention_bias``) are split over the heads with their weights (``Shard(0)``);
  - multi-head latent attention (Megatron's MLA plan): the down projections and latent norms are
    replicated DTensors fed the gathered sequence (each TP rank back-propagates only its heads, so
    their gradients arrive ``Partial`` and are summed over TP), the up projections column-parallel
    over heads, ``o_proj`` row-parallel; the shared rotary key leaves the replicated part as a
    local tensor whose gradient is declared partial (``rope_key``);
  - GPT-OSS's attention sinks ``[heads]`` are sharded over the heads as ``q_proj``'s rows (each rank
    hands its core attention its local sinks); ``o_proj``'s bias is a replicated DTensor added by
    the row-parallel linear once, to the reduced output;
  - OLMoE's q/k norm over the whole projection (``qk_norm='full'``) gathers the head-sharded
    projection, normalises it with a replicated weight and hands each rank its heads back;
  - every MoE layer receives this rank's *local* sequence slice
    (:func:`~lightning_moe.parallel.tensor_parallel.shard_moe_input`);
  - the output head is column-parallel over the vocabulary (it gathers the sequence, as
    Megatron's sequence parallelism does before the head) and its logits stay sharded: each TP
    rank holds ``[B, S, V / TP]`` of them, the model's loss is the vocabulary-parallel
    cross-entropy (:mod:`~lightning_moe.parallel.vocab_parallel_loss`, attached as
    ``model.vocab_parallel``) and only inference gathers them (``model.full_logits``).

  It requires the vocabulary, the head counts and the FFN width to divide by TP, and untied
  embeddings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_moe.layers.moe import MoELayer
from lightning_moe.models.attention import Attention, CoreAttention
from lightning_moe.models.mla import MultiLatentAttention
from lightning_moe.models.rope import rotary_cos_sin
from lightning_moe.parallel.context_parallel.apply import context_parallel_positions
from lightning_moe.parallel.model_plan import (
    ContextParallelPlan,
    ModelPlan,
    PipelineParts,
    TensorParallelPlan,
    child_names,
)
from lightning_moe.parallel.tensor_parallel import GatheredNormParallel, ReplicateParallel, shard_moe_input
from lightning_moe.parallel.vocab_parallel_embedding import VocabParallelEmbedding
from lightning_moe.parallel.vocab_parallel_loss import VocabParallelLogits

if TYPE_CHECKING:  # the model module imports this one at call time
    from lightning_moe.models.transformer import MoETransformer

__all__ = [
    "RECOMPUTE_TARGETS",
    "check_tensor_parallel_sizes",
    "pipeline_parts",
    "shard_tensor_parallel",
    "tensor_parallel_plan",
    "transformer_plan",
]

RECOMPUTE_TARGETS = {
    "layernorm": ("attn_norm", "ffn_norm"),
    "core_attn": (CoreAttention,),
    "attention": (Attention, MultiLatentAttention),
}
"""The modules selective recompute finds by default in the reference model, per name."""


def transformer_plan(model: MoETransformer) -> ModelPlan:
    """The :class:`~lightning_moe.parallel.model_plan.ModelPlan` of ``model`` (module docstring)."""
    blocks = child_names(model, "layers")
    return ModelPlan(
        context_parallel=ContextParallelPlan(
            attention=tuple(name for name, m in model.named_modules() if type(m) is CoreAttention),
            position_kwarg="position_ids",
            max_seq_len=model.config.max_seq_len,
        ),
        pipeline=lambda: pipeline_parts(model),
        fsdp_units=("embed", *blocks, "norm", "lm_head"),  # pieces a pipeline split dropped are None: skipped
        recompute=RECOMPUTE_TARGETS,
        graph_blocks=blocks,
        tensor_parallel=TensorParallelPlan(
            apply=lambda mesh: shard_tensor_parallel(model, mesh),
            problems=lambda tp: _tensor_parallel_problems(model, tp),
        ),
    )


# ----------------------------------------------------------------------------- pipeline parallelism


def pipeline_parts(model: MoETransformer) -> PipelineParts:
    """Blocks ``layers``, first piece ``embed``, last pieces ``norm`` and ``lm_head``; ``ValueError`` when tied."""
    config = model.config
    if config.tie_embeddings:
        raise ValueError(
            "MoETransformer(tie_embeddings=True) cannot be split into pipeline stages: the embedding (first "
            "stage) and the head (last stage) would share one weight on two ranks. Use tie_embeddings=False "
            "with pipeline_parallel_size > 1."
        )

    # The rotary tables depend only on the sequence length (and, under context parallelism, on which
    # chunks this CP rank holds): computed on the stage, not sent, once per length and device for
    # every block and step. The CP position hook on the transformer's forward never runs here, so
    # the stage asks for the chunks' positions.
    tables: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}

    def block(layer: nn.Module, hidden: Tensor) -> Tensor:
        seq = hidden.shape[1]  # a DTensor's (TP sequence sharding) is over TP: this CP rank's share
        key = (seq, hidden.device)
        if key not in tables:
            positions = context_parallel_positions(model, seq, hidden.device)
            tables[key] = rotary_cos_sin(seq, config.rotary_dim, config.rope_theta, hidden.device,
                                         config.rope_scaling, positions=positions)
        cos, sin = tables[key]
        return layer(hidden, cos, sin, None)

    return PipelineParts(
        blocks="layers", first=("embed",), last=("norm", "lm_head"),
        embed=lambda tokens: model.embed(tokens), block=block, head=lambda hidden: model.lm_head(model.norm(hidden)),
    )


# ------------------------------------------------------------------------------- tensor parallelism


def check_tensor_parallel_sizes(model: nn.Module, tp: int) -> None:
    """Raise unless ``tp`` divides the vocabulary, head counts and FFN width of ``model.config`` (untied).

    ``TypeError`` when ``model`` has no ``config``; reads only ``vocab_size``, ``num_attention_heads``,
    ``num_kv_heads``, ``ffn_hidden_size`` and ``tie_embeddings``.
    """
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


def _tensor_parallel_problems(model: nn.Module, tp: int) -> list[str]:
    try:
        check_tensor_parallel_sizes(model, tp)
    except (TypeError, ValueError) as err:
        return [str(err)]
    return []


def _rope_key_to_local(module: nn.Module, args: tuple) -> tuple:
    """The shared rotary key as a local tensor, its gradient (from this rank's heads only) partial."""
    (k_rot,) = args
    if isinstance(k_rot, DTensor):
        k_rot = k_rot.to_local(grad_placements=(Partial(),))
    return (k_rot,)


def _sinks_to_local(module: nn.Module, args: tuple) -> tuple:
    """The head-sharded attention sinks as this rank's local ``[heads / TP]`` (gradient stays sharded)."""
    if len(args) > 3 and isinstance(args[3], DTensor):
        args = (*args[:3], args[3].to_local(), *args[4:])
    return args


def _shard_sinks(attention: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard ``attention.sinks`` over the heads (as q_proj's rows) and hand the core attention the local part."""
    attention.sinks = nn.Parameter(distribute_tensor(attention.sinks.detach(), tp_mesh, [Shard(0)]))
    # Registered on whatever sits at core_attn now: context parallelism, applied first, swapped it.
    attention.core_attn.register_forward_pre_hook(_sinks_to_local)


def tensor_parallel_plan(model: MoETransformer) -> dict[str, object]:
    """The ``parallelize_module`` plan of ``model``, by submodule name."""
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


def shard_tensor_parallel(model: MoETransformer, tp_mesh: DeviceMesh) -> None:
    """Shard ``model`` over the 1-D ``tp_mesh`` (module docstring); the sizes checked first."""
    tp = tp_mesh.size()
    check_tensor_parallel_sizes(model, tp)

    def check_sequence_length(module: nn.Module, args: tuple) -> None:
        if args[0].shape[1] % tp:
            raise ValueError(
                f"Sequence length {args[0].shape[1]} is not divisible by the tensor parallel size {tp}; "
                "sequence parallelism splits every sequence into equal slices: choose a multiple of TP."
            )

    model.register_forward_pre_hook(check_sequence_length)
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model))
    model.vocab_parallel = VocabParallelLogits(tp_mesh, model.config.vocab_size)
    for block in model.layers:
        if isinstance(block.attn, MultiLatentAttention):
            block.attn.rope_key.register_forward_pre_hook(_rope_key_to_local)
        elif getattr(block.attn, "sinks", None) is not None:
            _shard_sinks(block.attn, tp_mesh)
    for block in model.layers:
        if isinstance(block.ffn, MoELayer):
            shard_moe_input(block.ffn, tp_mesh)
