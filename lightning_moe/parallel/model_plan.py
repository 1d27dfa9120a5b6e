"""`ModelPlan`: what a model declares so that every parallel and memory feature can serve it.

Expert parallelism needs nothing from a model: it finds every :class:`~lightning_moe.MoELayer`.
The other features need to know parts of the model: which modules are attention, how the model
splits into pipeline stages, which modules are FSDP2 units, which blocks a CUDA graph may
capture. A model hands that over by defining one method, ``parallel_plan(self) -> ModelPlan``;
``lightning_moe.parallel``, ``lightning_moe.memory`` and ``lightning_moe.graphs`` find every
module of the model tree that defines it (:func:`planned_modules`) and use only what the plan
says. The reference :class:`~lightning_moe.models.MoETransformer` is one implementation
(``lightning_moe/models/parallel_plan.py``); a user's model gets the same features by writing its
own. Every field is optional: a feature whose field is empty is refused for the model with an
error that names the field (context and pipeline parallelism), or finds nothing to apply to.

Fields (all names are qualified module names relative to the model that returns the plan):

``context_parallel`` (:class:`ContextParallelPlan`)
    The core-attention modules, ``forward(q, k, v)`` with ``[B, heads, S, D]`` tensors
    (``k``/``v`` may have fewer heads) and causal attention over ``S``; under
    ``context_parallel_size > 1`` each is replaced by
    :class:`~lightning_moe.parallel.context_parallel.apply.ContextParallelCoreAttention`, which
    attends over the whole sequence held by the CP ranks (a ``softmax_scale`` attribute is kept).
    The model then receives the global positions of this rank's chunks (``[S_local]`` integers)
    in the forward keyword ``position_kwarg``; ``max_seq_len`` bounds the whole sequence.
``pipeline``
    A callable returning :class:`PipelineParts` (the ordered blocks and the first and last
    pieces), called when the model is split; it may raise ``ValueError`` saying why this
    model cannot be split.
``fsdp_units``
    The modules each sharded as one FSDP2 unit, in forward order: each unit prefetches the next
    one's all-gather in forward and the previous one's in backward. Modules that share a
    parameter (a tied embedding and head) become one unit. Names whose module is ``None`` (a
    piece a pipeline split dropped) are skipped; what no unit covers is sharded per top-level
    module.
``recompute``
    The modules :func:`~lightning_moe.memory.apply_selective_recompute` finds by default for the
    names ``layernorm``, ``core_attn`` and ``attention``: module types or qualified-name
    patterns, as its ``targets`` (which still take precedence).
``graph_blocks``
    The blocks the CUDA-graph scopes capture (:mod:`lightning_moe.graphs`). Each follows
    :class:`GraphBlock`: ``forward`` calls ``attention_residual`` and then ``ffn_residual``, so
    the capture replaces those two methods, never a copy of the block's forward.
``tensor_parallel`` (:class:`TensorParallelPlan`)
    A function that shards the model over the tensor-parallel mesh (typically torch's
    ``parallelize_module`` with the model's own plan, plus
    :func:`~lightning_moe.parallel.tensor_parallel.shard_moe_input` on its MoE layers), and the
    sizes it cannot shard. Applied by :func:`~lightning_moe.parallel.parallelize`, after context
    and before expert parallelism.

Example, a user's language model with four of the features (see
``tests/strategies/test_model_plan.py`` for one trained model per feature)::

    from lightning_moe.parallel.model_plan import ContextParallelPlan, ModelPlan, PipelineParts, child_names

    class MyLM(nn.Module):
        def forward(self, tokens, positions=None): ...   # blocks: norm1, attn (attn.core), norm2, moe

        def parallel_plan(self) -> ModelPlan:
            blocks = child_names(self, "blocks")
            return ModelPlan(
                context_parallel=ContextParallelPlan(
                    attention=tuple(f"{b}.attn.core" for b in blocks), position_kwarg="positions"),
                pipeline=lambda: PipelineParts(
                    blocks="blocks", first=("embed",), last=("head",),
                    embed=self.embed, block=lambda block, x: block(x), head=self.head),
                fsdp_units=("embed", *blocks, "head"),
                recompute={"layernorm": ("norm1", "norm2"), "attention": ("blocks.*.attn",)},
            )

A model may instead define only ``pipeline_parts(self) -> PipelineParts`` (the older form of the
``pipeline`` field); :func:`plan_of` reads it as a plan with that field alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "ContextParallelPlan",
    "GraphBlock",
    "ModelPlan",
    "PipelineParts",
    "TensorParallelPlan",
    "child_names",
    "plan_of",
    "planned_modules",
    "resolve",
]


@dataclass(frozen=True)
class PipelineParts:
    """How a model splits into pipeline stages (:mod:`lightning_moe.parallel.pipeline.split`).

    Attributes:
        blocks: name of the attribute holding the ordered blocks (an ``nn.ModuleList``).
        first: attribute names of the modules only the first stage runs (the embedding).
        last: attribute names of the modules only the last stage runs (final norm, head).
        embed: ``inputs -> hidden``, on the first stage (uses only ``first``'s modules).
        block: ``(block, hidden) -> hidden``, one block; it keeps the hidden states' shape, dtype
            and layout (the pipeline's shape probe relies on it and runs no block after the first stage).
        head: ``hidden -> outputs`` (e.g. logits), on the last stage (uses only ``last``'s modules).
    """

    blocks: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    embed: Callable[[Tensor], Tensor]
    block: Callable[[nn.Module, Tensor], Tensor]
    head: Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class ContextParallelPlan:
    """The model's attention under context parallelism (module docstring, ``context_parallel``)."""

    attention: tuple[str, ...]
    """Qualified names of the core-attention modules (``forward(q, k, v)``, causal, ``[B, heads, S, D]``)."""
    position_kwarg: str | None = None
    """The forward keyword that takes the ``[S_local]`` global positions of this rank's chunks (None:
    the model takes none, e.g. it has no position encoding or asks
    :func:`~lightning_moe.parallel.context_parallel.apply.context_parallel_positions` itself)."""
    max_seq_len: int | None = None
    """The longest whole sequence (``CP x`` the local length) the model accepts; None: no limit."""


def _no_problems(tp: int) -> list[str]:
    return []


@dataclass(frozen=True)
class TensorParallelPlan:
    """How the model shards itself over the tensor-parallel mesh (module docstring, ``tensor_parallel``)."""

    apply: Callable[[DeviceMesh], None]
    """Shard the model in place over the 1-D ``tp`` mesh; every MoE layer inside must be fed this rank's
    tokens (:func:`~lightning_moe.parallel.tensor_parallel.shard_moe_input`)."""
    problems: Callable[[int], list[str]] = _no_problems
    """Every reason a TP size cannot shard the model (pure arithmetic, checked before any process starts)."""


@dataclass(frozen=True)
class ModelPlan:
    """What a model declares through ``parallel_plan()`` (see the module docstring for each field)."""

    context_parallel: ContextParallelPlan | None = None
    pipeline: Callable[[], PipelineParts] | None = None
    fsdp_units: tuple[str, ...] = ()
    recompute: Mapping[str, tuple[type[nn.Module] | str, ...]] = field(default_factory=dict)
    graph_blocks: tuple[str, ...] = ()
    tensor_parallel: TensorParallelPlan | None = None


class GraphBlock(Protocol):
    """A block the CUDA-graph scopes capture: ``forward`` is ``ffn_residual(attention_residual(x, ...), mask)``.

    ``attention_residual(x, *tensors)`` is the ``attn`` scope (it uses every child but ``ffn_norm``
    and ``ffn``); ``ffn_residual(x, padding_mask)`` computes ``x + ffn(ffn_norm(x), padding_mask)``,
    which the MoE scopes split when ``ffn`` is an ``MoELayer``.
    """

    ffn_norm: nn.Module | None
    ffn: nn.Module

    def attention_residual(self, x: Tensor, *args: Tensor) -> Tensor:
        """``x`` plus the attention of the normalised ``x``."""
        ...

    def ffn_residual(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """``x + ffn(ffn_norm(x), padding_mask)``."""
        ...


def plan_of(module: nn.Module) -> ModelPlan | None:
    """``module.parallel_plan()``, a plan of ``module.pipeline_parts`` alone, or None when it defines neither."""
    method = getattr(module, "parallel_plan", None)
    if callable(method):
        plan = method()
        if not isinstance(plan, ModelPlan):
            raise TypeError(
                f"{type(module).__name__}.parallel_plan() returned {type(plan).__name__}, not "
                "lightning_moe.parallel.model_plan.ModelPlan."
            )
        return plan
    parts = getattr(module, "pipeline_parts", None)
    if callable(parts):
        return ModelPlan(pipeline=parts)
    return None


def planned_modules(model: nn.Module) -> list[tuple[str, nn.Module, ModelPlan]]:
    """``(qualified name, module, plan)`` of every module of ``model`` with a plan, outermost only."""
    found: list[tuple[str, nn.Module, ModelPlan]] = []
    inside: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        plan = plan_of(module)
        if plan is not None:
            found.append((name, module, plan))
            inside.update(id(m) for m in module.modules())
    return found


def resolve(model: nn.Module, name: str) -> nn.Module | None:
    """The submodule ``name`` of ``model``; None when a step of the path holds None (a dropped piece).

    ``AttributeError`` naming the model when the path does not exist.
    """
    module: nn.Module | None = model
    for part in name.split(".") if name else ():
        if module is None:
            return None
        if part not in module._modules:
            raise AttributeError(
                f"{type(model).__name__}.parallel_plan() names {name!r}, but {type(module).__name__} has no "
                f"submodule {part!r}; name modules by their qualified names (model.named_modules())."
            )
        module = module._modules[part]
    return module


def child_names(model: nn.Module, attribute: str) -> tuple[str, ...]:
    """Qualified names of the children of ``model.<attribute>`` (an ``nn.ModuleList`` or, once a pipeline
    split kept only some, an ``nn.ModuleDict`` keyed by the original indices), in order."""
    container = getattr(model, attribute)
    return tuple(f"{attribute}.{key}" for key in container._modules)
