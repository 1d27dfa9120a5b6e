"""Splitting a model into pipeline stages by layer, and the protocol a model opts in through.

A model is split into ``P * V`` stages (``P`` pipeline ranks, ``V`` virtual stages per rank): its
ordered blocks are dealt out in contiguous runs, the first piece (the embedding) goes with the
first stage and the last pieces (final norm, head) with the last stage, as Megatron's
``PipelineParallelLayout`` does by default. Each rank keeps only its own stages' modules: the
model is *trimmed in place* (the blocks' ``nn.ModuleList`` becomes an ``nn.ModuleDict`` keyed by
the original indices, pieces of other stages become ``None``), so ``state_dict`` keys stay the
global ones (``model.layers.5.ffn...``): a checkpoint of one pipeline layout loads into another,
or into one process.

A model opts in through its plan (:mod:`lightning_moe.parallel.model_plan`): ``parallel_plan()``
returning a :class:`~lightning_moe.parallel.model_plan.ModelPlan` whose ``pipeline`` gives the
:class:`PipelineParts`, or just ``pipeline_parts(self) -> PipelineParts``. Example::

    def pipeline_parts(self):
        return PipelineParts(
            blocks="layers", first=("embed",), last=("norm", "head"),
            embed=lambda inputs: self.embed(inputs),
            block=lambda block, hidden: block(hidden),
            head=lambda hidden: self.head(self.norm(hidden)),
        )

Between stages only one tensor travels (the hidden states), so blocks take and return one tensor
(extra per-layer inputs, such as rotary tables, are recomputed from it in ``block``). Under context
parallelism the hidden states are this CP rank's chunks of each sequence; a model whose blocks need
the chunks' global positions asks
:func:`~lightning_moe.parallel.context_parallel.apply.context_parallel_positions` in ``block`` (the
reference transformer does). Its attention modules were swapped for the CP attention before the
split, and the stages keep them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_moe.parallel.model_plan import ModelPlan, PipelineParts, child_names, plan_of

__all__ = [
    "PipelineParts", "StageModule", "TrimRecord", "layer_split", "num_blocks_before_trim", "pipeline_parts_of",
    "stage_indices", "stage_to_rank", "trim_record", "trim_to_stages",
]


def pipeline_parts_of(model: nn.Module) -> PipelineParts:
    """The :class:`PipelineParts` ``model`` declares (its plan's ``pipeline``, or its ``pipeline_parts()``)."""
    plan = plan_of(model)
    if plan is None or plan.pipeline is None:
        raise TypeError(
            f"{type(model).__name__} cannot be split into pipeline stages: it defines no pipeline_parts() "
            "method and no parallel_plan() with a pipeline. Define pipeline_parts(self) -> "
            "lightning_moe.parallel.pipeline.split.PipelineParts (its ordered blocks plus the first and last "
            "pieces; see that module's docstring) or declare it in parallel_plan() "
            "(lightning_moe.parallel.model_plan), or use pipeline_parallel_size=1."
        )
    parts = plan.pipeline
    result = parts()
    if not isinstance(result, PipelineParts):
        raise TypeError(f"{type(model).__name__}'s pipeline parts are a {type(result).__name__}, not PipelineParts.")
    blocks = getattr(model, result.blocks, None)
    # A model trimmed to its stages by an earlier run (a second fit or validate) holds them in a ModuleDict.
    trimmed = isinstance(blocks, nn.ModuleDict) and trim_record(model) is not None
    if not isinstance(blocks, nn.ModuleList) and not trimmed:
        raise TypeError(f"{type(model).__name__}.{result.blocks} (PipelineParts.blocks) is not an nn.ModuleList.")
    return result


def layer_split(num_blocks: int, num_stages: int, split: Sequence[int] | None = None) -> list[int]:
    """Blocks per stage: ``split`` when given (checked), else as even as possible (earlier stages get more).

    Raises ``ValueError`` when a stage would get no block or the counts do not add up.
    """
    if split is not None:
        split = [int(n) for n in split]
        if len(split) != num_stages or sum(split) != num_blocks or min(split) < 1:
            raise ValueError(
                f"pipeline_layer_split={split}: needs {num_stages} positive counts (pipeline_parallel_size x "
                f"virtual_stages) summing to the model's {num_blocks} blocks."
            )
        return split
    if num_blocks < num_stages:
        raise ValueError(
            f"The model has {num_blocks} blocks, fewer than its {num_stages} pipeline stages "
            "(pipeline_parallel_size x virtual_stages); lower one of them."
        )
    base, extra = divmod(num_blocks, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


def stage_to_rank(stage: int, pp: int, style: str) -> int:
    """The pipeline rank holding ``stage``: ``"loop"`` (stage ``s`` on ``s % pp``) or ``"v"`` (zig-zag)."""
    lap, position = divmod(stage, pp)
    if style == "v" and lap % 2 == 1:
        return pp - 1 - position
    return position


def stage_indices(pp_rank: int, pp: int, virtual: int, style: str) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds, in increasing order."""
    return [s for s in range(pp * virtual) if stage_to_rank(s, pp, style) == pp_rank]


class StageModule(nn.Module):
    """One pipeline stage: (embedding on the first stage,) a run of blocks, (head on the last stage).

    Holds references to the model's own modules (registered here too, so the stage's
    ``parameters()`` are exactly its share; the model keeps them under their global names).
    Only plain tensors cross a stage boundary: a DTensor output (tensor parallelism shards the
    hidden states over the sequence) is sent as its local shard and wrapped again on the next
    stage with :attr:`input_layout`, which the runner sets from the sending stage's layout.
    """

    def __init__(self, model: nn.Module, parts: PipelineParts, block_ids: list[int], is_first: bool, is_last: bool):
        super().__init__()
        self._parts = parts
        self.is_first, self.is_last = is_first, is_last
        self.input_layout: tuple[DeviceMesh, tuple] | None = None
        """(mesh, placements) the received hidden states are a local shard of; None: plain tensors."""
        blocks = getattr(model, parts.blocks)
        self.blocks = nn.ModuleDict({str(i): blocks[str(i)] if isinstance(blocks, nn.ModuleDict) else blocks[i]
                                     for i in block_ids})
        self.pieces = nn.ModuleDict({
            name: getattr(model, name) for name in (*(parts.first if is_first else ()), *(parts.last if is_last else ()))
            if getattr(model, name, None) is not None
        })

    def parallel_plan(self) -> ModelPlan:
        """The stage's FSDP2 units, in forward order: its first pieces, its blocks, its last pieces."""
        first = tuple(f"pieces.{n}" for n in self._parts.first if n in self.pieces)
        last = tuple(f"pieces.{n}" for n in self._parts.last if n in self.pieces)
        return ModelPlan(fsdp_units=(*first, *child_names(self, "blocks"), *last))

    @property
    def parts(self) -> PipelineParts:
        """How the model this stage was cut from splits (its first and last pieces' names)."""
        return self._parts

    def forward(self, x: Tensor) -> Tensor:
        """Inputs (first stage) or hidden states -> hidden states, or outputs (last stage)."""
        if self.is_first:
            x = self._parts.embed(x)
        elif self.input_layout is not None:
            x = DTensor.from_local(x, *self.input_layout, run_check=False)
        for block in self.blocks.values():
            x = self._parts.block(block, x)
        if self.is_last:
            x = self._parts.head(x)
        return x.to_local() if isinstance(x, DTensor) else x

    def head_only(self, x: Tensor) -> Tensor:
        """The last stage's outputs for hidden states ``x`` without its blocks (to learn their shape)."""
        if self.input_layout is not None:
            x = DTensor.from_local(x, *self.input_layout, run_check=False)
        x = self._parts.head(x)
        return x.to_local() if isinstance(x, DTensor) else x


@dataclass(frozen=True)
class TrimRecord:
    """What :func:`trim_to_stages` kept of a model: its block count before, the kept block indices and pieces."""

    num_blocks: int
    block_ids: frozenset[int]
    first: bool
    last: bool


_TRIM_ATTR = "_lightning_moe_pipeline_trim"


def trim_record(model: nn.Module) -> TrimRecord | None:
    """How ``model`` was trimmed to pipeline stages (:func:`trim_to_stages`), None if it was not."""
    return getattr(model, _TRIM_ATTR, None)


def num_blocks_before_trim(model: nn.Module, parts: PipelineParts) -> int:
    """The number of blocks of the whole model, trimmed or not."""
    record = trim_record(model)
    return record.num_blocks if record is not None else len(getattr(model, parts.blocks))


def trim_to_stages(model: nn.Module, parts: PipelineParts, block_ids: set[int], first: bool, last: bool) -> None:
    """Drop from ``model`` every block and piece not in this rank's stages (global names kept).

    A model trimmed already (a second ``fit``, or a new Trainer and strategy) is left as it is if
    it holds exactly these stages; otherwise ``ValueError``: the dropped modules are gone.
    """
    wanted = TrimRecord(num_blocks_before_trim(model, parts), frozenset(block_ids), first, last)
    record = trim_record(model)
    if record is not None:
        if record != wanted:
            raise ValueError(
                f"This model was trimmed to pipeline stages by an earlier run: it holds blocks "
                f"{sorted(record.block_ids)} of {record.num_blocks} (first pieces: {record.first}, last pieces: "
                f"{record.last}), but this layout needs blocks {sorted(block_ids)} (first: {first}, last: {last}) "
                "on this rank. Use the earlier pipeline layout, or load a checkpoint into a fresh model "
                "(checkpoints reshard across layouts)."
            )
        return
    blocks = getattr(model, parts.blocks)
    setattr(model, parts.blocks, nn.ModuleDict({str(i): b for i, b in enumerate(blocks) if i in block_ids}))
    for name in (*(() if first else parts.first), *(() if last else parts.last)):
        setattr(model, name, None)
    setattr(model, _TRIM_ATTR, wanted)
