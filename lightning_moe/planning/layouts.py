"""Parallel layouts a world of ranks, a model and its data admit; where their groups cross nodes; how to run one.

Pure arithmetic on sizes: nothing here starts a process, builds a model or reads a file.

* :class:`Layout`: the sizes ``MoEStrategy`` takes (TP, CP, PP, EP, ETP, sharding strategy);
* :func:`valid_layouts`: every layout that :class:`~lightning_moe.parallel.ParallelDims` builds for
  a world size and that the model's and the data's sizes admit. The checks are the package's own
  (called, their errors caught), so the list cannot drift from what a launch would refuse;
* :func:`cross_node_warnings`: the group kinds whose groups span nodes, and how to keep them inside one;
* :func:`command_line`: the ``lightning-moe fit`` command that runs a configuration with a layout.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

from lightning_moe.cli_checks import sequence_multiple
from lightning_moe.models.parallel_plan import check_tensor_parallel_sizes
from lightning_moe.parallel.fully_shard import check_sharding_strategy
from lightning_moe.parallel.layout.check import expert_layer_problems
from lightning_moe.parallel.layout.dims import ParallelDims
from lightning_moe.parallel.pipeline.runner import check_pipeline_options, sharded_schedule_problem
from lightning_moe.parallel.pipeline.split import layer_split

__all__ = ["STRATEGY_CLASS_PATH", "Layout", "command_line", "cross_node_warnings", "valid_layouts"]

STRATEGY_CLASS_PATH = "lightning_moe.strategies.MoEStrategy"
"""The class path :func:`command_line` names the strategy by (the ``--trainer.strategy.init_args``
overrides need one); a string, so planning does not import Lightning."""

_SIZE_ARGS = (
    ("tp", "tensor_parallel_size"),
    ("cp", "context_parallel_size"),
    ("pp", "pipeline_parallel_size"),
    ("ep", "expert_parallel_size"),
    ("etp", "expert_tensor_parallel_size"),
)


@dataclass(frozen=True)
class Layout:
    """One parallel layout: the sizes and the sharding strategy ``MoEStrategy`` is given.

    Args:
        tp: tensor-parallel size (``tensor_parallel_size``).
        cp: context-parallel size (``context_parallel_size``).
        pp: pipeline-parallel size (``pipeline_parallel_size``).
        ep: expert-parallel size (``expert_parallel_size``).
        etp: expert tensor-parallel size (``expert_tensor_parallel_size``), always explicit here:
            the strategy's default (ETP = TP) is a different layout.
        sharding_strategy: ``"NO_SHARD"`` (replicated) or ``"FULL_SHARD"`` (FSDP2); the strategy's
            ``"SHARD_GRAD_OP"`` is accepted too.

    The rank order is the strategy's default (``tp-cp-ep-dp-pp``).
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    sharding_strategy: str = "NO_SHARD"

    def __post_init__(self) -> None:
        for name, _ in _SIZE_ARGS:
            _check_positive_int(f"Layout.{name}", getattr(self, name))
        check_sharding_strategy(self.sharding_strategy)

    def dims(self, world_size: int) -> ParallelDims:
        """The folded layout of these sizes over ``world_size`` ranks (`ValueError` if they do not fold)."""
        return ParallelDims(world_size, tp=self.tp, cp=self.cp, pp=self.pp, ep=self.ep, etp=self.etp)

    def strategy_args(self) -> dict[str, int | str]:
        """The ``MoEStrategy`` init_args this layout sets, by parameter name."""
        args: dict[str, int | str] = {arg: getattr(self, name) for name, arg in _SIZE_ARGS}
        args["sharding_strategy"] = self.sharding_strategy
        return args

    def describe(self) -> str:
        """One line, e.g. ``TP=2 CP=1 PP=1 EP=4 ETP=1 NO_SHARD``."""
        sizes = " ".join(f"{name.upper()}={getattr(self, name)}" for name, _ in _SIZE_ARGS)
        return f"{sizes} {self.sharding_strategy}"

    def __str__(self) -> str:
        return self.describe()


def valid_layouts(
    world_size: int,
    *,
    num_experts: int,
    num_attention_heads: int,
    num_kv_heads: int | None,
    num_layers: int,
    seq_len: int,
    batch_size: int,
    vocab_size: int | None = None,
    ffn_hidden_size: int | None = None,
    expert_ffn_hidden_size: int | None = None,
    hidden_size: int | None = None,
    fc2_bias: bool = False,
    tie_embeddings: bool = False,
    num_microbatches: int | None = None,
    pipeline_schedule: str = "1F1B",
    virtual_stages: int | None = None,
    sharding_strategies: Sequence[str] = ("NO_SHARD", "FULL_SHARD"),
) -> list[Layout]:
    """Every layout of ``world_size`` ranks the model and the data admit.

    Enumerated: every TP, CP, PP, EP, ETP that is a divisor of ``world_size`` with ``TP*CP*PP``
    and ``ETP*EP*PP`` dividing it (exactly the sizes :class:`~lightning_moe.parallel.ParallelDims`
    can fold at the default rank order; a power-of-two world has ``log2(world)+1`` divisors, so
    1024 ranks give about 12,000 size tuples), times each of ``sharding_strategies``. Ordered by
    PP, TP, CP, ETP, EP, then ``sharding_strategies``' order.

    Kept, by the package's own checks: the layout folds (``ParallelDims``); the experts split over
    EP and, when given, ``expert_ffn_hidden_size`` over ETP
    (:func:`~lightning_moe.parallel.layout.check.expert_layer_problems`; ``fc2_bias`` restricts no
    layout, since one ETP rank adds it); under TP the heads, the key/value heads and, when given, ``vocab_size`` and the dense ``ffn_hidden_size`` divide by TP,
    without ``tie_embeddings`` (``apply_tensor_parallel``'s check); ``seq_len`` is a multiple of
    :func:`~lightning_moe.cli_checks.sequence_multiple` (CP chunks, TP slices); under PP the
    ``num_layers`` blocks fill ``PP x virtual stages`` stages
    (:func:`~lightning_moe.parallel.pipeline.split.layer_split`), ``batch_size`` splits into
    ``num_microbatches`` and the schedule runs on the sharding strategy
    (:func:`~lightning_moe.parallel.pipeline.runner.sharded_schedule_problem`); sharded experts split
    ``hidden_size`` (when given) evenly over EDP.

    Not checked (they depend on the model object, not its sizes): MoE blocks that are not
    ``MoELayer`` s, layers outside a tensor-parallel plan. ``num_microbatches``,
    ``pipeline_schedule`` and ``virtual_stages`` are the strategy's pipeline options, checked
    once (`ValueError` if invalid) and applied to every layout with PP > 1.
    """
    ParallelDims(world_size)  # checks world_size
    for name, value in (("num_experts", num_experts), ("num_attention_heads", num_attention_heads),
                        ("num_layers", num_layers), ("seq_len", seq_len), ("batch_size", batch_size)):
        _check_positive_int(name, value)
    for name, value in (("num_kv_heads", num_kv_heads), ("vocab_size", vocab_size), ("ffn_hidden_size", ffn_hidden_size),
                        ("expert_ffn_hidden_size", expert_ffn_hidden_size), ("hidden_size", hidden_size)):
        if value is not None:
            _check_positive_int(name, value)
    shardings = [check_sharding_strategy(s) for s in sharding_strategies]
    micro, virtual = check_pipeline_options(pipeline_schedule, num_microbatches, virtual_stages)
    # The stand-ins the package's checks read (the TP check skips widths that are None; an expert width
    # not given is 0, which every ETP divides).
    transformer = SimpleNamespace(config=SimpleNamespace(
        vocab_size=vocab_size, num_attention_heads=num_attention_heads, num_kv_heads=num_kv_heads,
        ffn_hidden_size=ffn_hidden_size, tie_embeddings=tie_embeddings,
    ))
    moe = SimpleNamespace(num_experts=num_experts, ffn_hidden_size=expert_ffn_hidden_size or 0, fc2_bias=fc2_bias)

    def tp_fits(tp: int) -> bool:
        if tp == 1:  # as layout_problems: the TP checks apply under TP only
            return True
        try:
            check_tensor_parallel_sizes(transformer, tp)
        except (TypeError, ValueError):
            return False
        return True

    def pp_fits(pp: int) -> bool:
        if pp == 1:  # no pipeline: its options are not used
            return True
        try:
            layer_split(num_layers, pp * virtual)
        except ValueError:
            return False
        # cli_checks.config_problems' batch check, which has no function of its own to call.
        return batch_size % micro == 0

    def sharding_fits(dims: ParallelDims, sharding: str) -> bool:
        if dims.pp > 1 and sharded_schedule_problem(pipeline_schedule, sharding) is not None:
            return False
        # check_fully_shard's expert check (it needs the model): FSDP2 splits the experts' hidden size over EDP.
        return sharding == "NO_SHARD" or hidden_size is None or dims.edp == 1 or hidden_size % dims.edp == 0

    layouts = []
    for pp in _divisors(world_size):
        if not pp_fits(pp):
            continue
        per_stage = _divisors(world_size // pp)
        dense = [(tp, cp) for tp in per_stage if tp_fits(tp)
                 for cp in _divisors(world_size // pp // tp) if seq_len % sequence_multiple(cp, tp) == 0]
        # The expert and sharding checks read the world, PP, EP and ETP only: asked once per (ETP, EP) at
        # this PP, not again for every dense size.
        admitted: dict[tuple[int, int], list[str]] = {}
        for tp, cp in dense:
            for etp in per_stage:
                for ep in _divisors(world_size // pp // etp):
                    try:
                        dims = ParallelDims(world_size, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
                    except ValueError:
                        continue
                    if (etp, ep) not in admitted:
                        fits = not expert_layer_problems(moe, dims)
                        admitted[etp, ep] = [s for s in shardings if fits and sharding_fits(dims, s)]
                    layouts.extend(Layout(tp, cp, pp, ep, etp, s) for s in admitted[etp, ep])
    return layouts


# Group kind -> (label, which side of the folded layout, its axis in the order string, what crosses nodes).
_CROSS_NODE_KINDS = {
    "tp": ("TP", "dense", "tp", "the tensor-parallel collectives of every layer"),
    "cp": ("CP", "dense", "cp", "the context-parallel key/value exchange of every attention layer"),
    "ep": ("EP", "expert", "ep", "the token all-to-all of every MoE layer"),
    "etp": ("ETP", "expert", "tp", "the expert tensor-parallel collectives of every MoE layer"),
}
_AXIS_LABELS = {
    "dense": {"tp": "TP", "cp": "CP", "ep": "EP", "dp": "DP", "pp": "PP"},
    "expert": {"tp": "ETP", "cp": "CP", "ep": "EP", "dp": "EDP", "pp": "PP"},
}


def cross_node_warnings(dims: ParallelDims, devices_per_node: int) -> list[str]:
    """One warning per TP, CP, EP and ETP group kind whose groups span nodes, in that order.

    Rank ``r`` is on node ``r // devices_per_node``. Each warning names the group kind, its size,
    the nodes one group spans, the devices per node and the fix: the axes laid out before and
    including the kind's in the rank order (``dims.order``, leftmost fastest) make up blocks of
    consecutive ranks, and a group stays on one node when that product divides ``devices_per_node``.
    """
    _check_positive_int("devices_per_node", devices_per_node)
    sizes = {
        "dense": {"tp": dims.tp, "cp": dims.cp, "ep": 1, "dp": dims.dp, "pp": dims.pp},
        "expert": {"tp": dims.etp, "cp": 1, "ep": dims.ep, "dp": dims.edp, "pp": dims.pp},
    }
    order = dims.order.split("-")
    warnings = []
    for name, (label, side, axis, traffic) in _CROSS_NODE_KINDS.items():
        groups = dims.groups(name)
        spans = [len({rank // devices_per_node for rank in group}) for group in groups]
        if max(spans) == 1:
            continue
        group = groups[spans.index(max(spans))]
        block = [a for a in order[: order.index(axis) + 1] if a == axis or sizes[side][a] > 1]
        product = 1
        for a in block:
            product *= sizes[side][a]
        expression = "*".join(_AXIS_LABELS[side][a] for a in block)
        now = str(product) if len(block) == 1 else f"{'*'.join(str(sizes[side][a]) for a in block)} = {product}"
        warnings.append(
            f"{label} groups span up to {max(spans)} nodes: {len(group)} ranks each (e.g. ranks {_ranks_text(group)}) "
            f"with {devices_per_node} devices per node, so {traffic} would cross the network between nodes. "
            f"Make {expression} (now {now}) divide {devices_per_node} to keep each {label} group on one node."
        )
    return warnings


def command_line(base_args: Sequence[str], layout: Layout) -> str:
    """The shell-quoted ``lightning-moe fit`` command running ``base_args`` with ``layout``.

    ``base_args`` are the arguments after ``fit`` (e.g. ``["--config", "x.yaml"]``). The strategy's
    class path comes first, so a configuration that names no strategy gets one and a configuration
    that does (after it) keeps its other init_args; the layout's ``--trainer.strategy.init_args.*``
    overrides come last, so they win over the configuration's.
    """
    if isinstance(base_args, str):
        raise TypeError(f"base_args must be a list of arguments, not one string: {base_args!r}; use shlex.split.")
    overrides = [f"--trainer.strategy.init_args.{key}={value}" for key, value in layout.strategy_args().items()]
    return shlex.join(["lightning-moe", "fit", f"--trainer.strategy={STRATEGY_CLASS_PATH}", *base_args, *overrides])


def _ranks_text(group: list[int]) -> str:
    if len(group) <= 4:
        return ", ".join(map(str, group))
    return f"{group[0]}, {group[1]}, ..., {group[-1]}"


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
