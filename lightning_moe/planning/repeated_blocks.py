"""Plan a stage of many identical blocks from fake steps with one and two of them.

A fake step costs about the same for every op, so a stage of ``n`` blocks costs ``n`` times one
block, for every micro-batch of two optimizer steps: a minute per stage of DeepSeek-V3. But what
a rank holds grows by the same amount with each block of one kind (its parameters, gradients and
optimizer states, the activations each micro-batch keeps of it, its collectives), so it is planned
from runs that keep 1 and 2 blocks of each such kind, the rest of the model as it is:

    value(n) = value(1 block) + (n - 1) * (value(2 blocks) - value(1 block))

for every byte count of the step, per kind, and for the peak of each phase of the step (forward,
backward, optimizer) apart: their slopes differ (the forward's peak grows by what a block keeps
for backward, the backward's by that less what it frees), so the step's peak, the largest of
them, moves from one phase to another as blocks are added and is not itself a straight line. Blocks are of one kind when their module types and
parameter shapes are the same (DeepSeek-V3's dense and MoE blocks are two kinds). A kind is cut only
where that saves work (counted in blocks run, each run's setup as one more: a stage of 8 blocks of
one kind runs 1 + 2 blocks in two runs). ``plan(..., fast=True)`` asks for it; by default every
block runs. It is exact on the small layouts of the tests (`tests/planning/test_repeated_blocks.py`);
on DeepSeek-V3's last pipeline stage at 256 ranks (7 MoE blocks, recompute, FSDP2) it is 2.3 times
faster and puts the peak 1.3% higher than running every block: there one and two blocks do not yet
show the interior pattern (neighbours prefetched, recomputed in backward) of seven. The cut happens on the meta-device model, before the strategy splits and shards it, through
the same pipeline parts (`~lightning_moe.parallel.pipeline.split.PipelineParts`) pipeline
parallelism uses: models without them run whole.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch import nn

from lightning_moe.parallel.pipeline.split import layer_split, pipeline_parts_of

__all__ = ["BlockCut", "cut_blocks", "extrapolate", "stage_signatures"]

_SETUP = 1
"""What a run costs besides its blocks (the model's setup, the embedding, the head), in blocks."""


@dataclass(frozen=True)
class BlockCut:
    """Which blocks a planning run keeps of the rank's stage: one block of each kind that is cut,
    two of kind ``grown`` (an index into the stage's kinds in order of appearance; None: none)."""

    grown: int | None = None


def _kind(block: nn.Module) -> tuple:
    return (tuple(type(m).__qualname__ for m in block.modules()),
            tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters()))


def _network(module: nn.Module) -> nn.Module | None:
    for child in module.children():
        try:
            pipeline_parts_of(child)
        except TypeError:
            continue
        return child
    return None


def _stage_blocks(network: nn.Module, pp: int, split: list[int] | None) -> tuple[list[nn.Module], list[int]]:
    blocks = list(getattr(network, pipeline_parts_of(network).blocks))
    return blocks, (layer_split(len(blocks), pp, split) if pp > 1 else [len(blocks)])


def _kept(mine: list[nn.Module], cut: BlockCut) -> tuple[list[tuple], dict[int, int], list[int]]:
    """The stage's blocks' kinds, the kinds cut with the blocks of each on the stage, and the
    positions of the blocks a run keeps."""
    kinds: dict[tuple, int] = {}
    of_kind = [kinds.setdefault(_kind(b), len(kinds)) for b in mine]
    held = Counter(of_kind)
    cut_kinds = {k: held[k] for k in _cheapest_cut(held)}
    kept, seen = [], Counter()
    for position, kind in enumerate(of_kind):
        wanted = 1 + (kind == cut.grown) if kind in cut_kinds else held[kind]
        if seen[kind] < wanted:
            kept.append(position)
            seen[kind] += 1
    return list(kinds), cut_kinds, kept


def cut_blocks(module: nn.Module, pp_rank: int, pp: int, virtual_stages: int, split: list[int] | None,
               cut: BlockCut) -> tuple[dict[int, int], list[int] | None]:
    """Cut the blocks of pipeline rank ``pp_rank``'s stage of ``module``'s network (meta) as ``cut`` says.

    Returns ``({kind: blocks of it on the rank}`` for each kind cut, the pipeline's blocks per stage
    after the cut (None without PP)); nothing is cut (``{}``) for a network without pipeline parts or
    with several stages per rank.
    """
    network = _network(module)
    if network is None or virtual_stages != 1:
        return {}, split
    blocks, counts = _stage_blocks(network, pp, split)
    start = sum(counts[:pp_rank])
    mine = blocks[start:start + counts[pp_rank]]
    _, cut_kinds, kept = _kept(mine, cut)
    if not cut_kinds:
        return {}, split
    setattr(network, pipeline_parts_of(network).blocks,
            nn.ModuleList([*blocks[:start], *(mine[i] for i in kept), *blocks[start + len(mine):]]))
    if pp == 1:
        return cut_kinds, split
    return cut_kinds, [*counts[:pp_rank], len(kept), *counts[pp_rank + 1:]]


def stage_signatures(module: nn.Module, pp: int, virtual_stages: int,
                     split: list[int] | None) -> list[tuple[tuple, dict[int, int]]] | None:
    """Per pipeline rank of ``module``'s network (meta, whole): ``(signature, held)``, the signature
    being the kinds of the blocks its planning runs keep, in order, and which of them are cut;
    ``held`` how many blocks of each cut kind the stage has (as `cut_blocks` returns them). Stages
    of one signature run the same model in their planning runs and differ only in their place in
    the pipeline schedule (`lightning_moe.planning.stage_roles`). None for a network without
    pipeline parts or with several stages per rank."""
    network = _network(module)
    if network is None or virtual_stages != 1:
        return None
    blocks, counts = _stage_blocks(network, pp, split)
    signatures, start = [], 0
    for count in counts:
        mine = blocks[start:start + count]
        start += count
        _, cut_kinds, kept = _kept(mine, BlockCut())
        signatures.append(((tuple(_kind(mine[i]) for i in kept), tuple(sorted(cut_kinds))), cut_kinds))
    return signatures


def _cheapest_cut(held: Counter) -> tuple[int, ...]:
    """The kinds to cut so that the runs cost least (none when cutting saves nothing)."""
    def cost(kinds: tuple[int, ...]) -> int:
        base = sum(1 if k in kinds else n for k, n in held.items())
        return base + _SETUP + len(kinds) * (base + 1 + _SETUP)

    candidates = [k for k, n in held.items() if n > 2]
    choices = [tuple(k for i, k in enumerate(candidates) if mask >> i & 1) for mask in range(2 ** len(candidates))]
    return min(choices, key=lambda kinds: (cost(kinds), len(kinds)))


def extrapolate(base: float, grown: dict[int, float], held: dict[int, int]) -> float:
    """A value of the whole stage from the run with one block per cut kind (``base``) and, per kind,
    the run with two of it (``grown[kind]``); ``held[kind]`` blocks of each kind on the rank."""
    return base + sum((held[k] - 1) * (grown[k] - base) for k in held)
