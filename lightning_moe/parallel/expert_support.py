"""Whether expert parallelism has anything to shard in a model: its MoE blocks must be ``MoELayer`` s.

:func:`~lightning_moe.parallel.apply_expert_parallel` shards the experts of every
:class:`~lightning_moe.MoELayer` over EP (and ETP) and leaves every other module replicated. A
model whose MoE blocks are something else (Hugging Face ``transformers``' sparse-MoE blocks of a
``MixtralForCausalLM``, say) would therefore train as plain data parallelism, every rank holding
every expert, while the layout claims EP > 1: :func:`expert_parallel_support_problem` says why
such a layout is refused. ``MoEStrategy`` raises it at setup; the ``lightning-moe`` CLI lists it
before launching (:func:`~lightning_moe.parallel.layout.check.layout_problems`).

The known blocks are recognised by class name, so no ``transformers`` import is needed.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from lightning_moe.layers.moe import MoELayer
from lightning_moe.parallel.layout.dims import ParallelDims

__all__ = ["HF_SPARSE_MOE_BLOCKS", "expert_parallel_support_problem", "hf_sparse_moe_blocks"]

HF_SPARSE_MOE_BLOCKS = {
    "MixtralSparseMoeBlock": "Mixtral",
    "Qwen2MoeSparseMoeBlock": "Qwen2-MoE",
    "Qwen3MoeSparseMoeBlock": "Qwen3-MoE",
    "OlmoeSparseMoeBlock": "OLMoE",
    "DeepseekV3MoE": "DeepSeek-V3",
    "GptOssMLP": "GPT-OSS",
    "Glm4MoeMoE": "GLM-4.5",
}
"""Class names of ``transformers``' sparse-MoE blocks (5.x) -> the model family they belong to."""

_WAY_OUT = (
    "replace them with lightning_moe.MoELayer (lightning_moe.swap_moe_blocks(model) will do it once available), "
    "or use expert_parallel_size=1 and expert_tensor_parallel_size=1"
)


def hf_sparse_moe_blocks(model: nn.Module) -> Counter[str]:
    """How many modules of ``model`` are of each class of :data:`HF_SPARSE_MOE_BLOCKS`, by class name."""
    return Counter(type(m).__name__ for m in model.modules() if type(m).__name__ in HF_SPARSE_MOE_BLOCKS)


def expert_parallel_support_problem(model: nn.Module, dims: ParallelDims) -> str | None:
    """Why the expert layout of ``dims`` would not shard ``model``'s experts (None if it would).

    Asked for when EP > 1 or ETP > 1: a model holding Hugging Face sparse-MoE blocks (by class
    name) is refused, naming them and the way out; so is a model without any
    :class:`~lightning_moe.MoELayer` (nothing to shard), unless ETP is only the tensor-parallel
    size it defaults to (a dense model under TP has no experts to lay out).
    """
    if dims.ep == 1 and dims.etp == 1:
        return None
    sizes = f"expert_parallel_size={dims.ep}, expert_tensor_parallel_size={dims.etp}"
    blocks = hf_sparse_moe_blocks(model)
    if blocks:
        found = ", ".join(f"{count} {name} ({HF_SPARSE_MOE_BLOCKS[name]})" for name, count in sorted(blocks.items()))
        return (
            f"{sizes} shards the experts of lightning_moe.MoELayer modules only, but {type(model).__name__} holds "
            f"Hugging Face sparse-MoE blocks: {found}. Their experts would stay whole on every rank (plain data "
            f"parallelism, not the layout asked for). To shard them, {_WAY_OUT}."
        )
    if (dims.ep > 1 or dims.etp not in (1, dims.tp)) and not any(isinstance(m, MoELayer) for m in model.modules()):
        return (
            f"{sizes} shards the experts of lightning_moe.MoELayer modules, but {type(model).__name__} has none: "
            "nothing would be sharded and every rank would hold the whole model. Build the MoE blocks from "
            "lightning_moe.MoELayer (lightning_moe.MoETransformer for a whole language model), or use "
            "expert_parallel_size=1 and expert_tensor_parallel_size=1."
        )
    return None
