"""CUDA-graph scopes: their names, when each is legal, and the staged forwards they capture.

A *scope* names a part of every transformer layer that is captured into one CUDA graph per layer
(Megatron Core's ``cuda_graph_modules``):

``attn``
    a block's ``attention_residual``, e.g. the reference
    :class:`~lightning_moe.models.TransformerBlock`'s ``x + attn(attn_norm(x))``: the attention
    norm, the attention and the residual add.
``moe_router``
    the pre-MoE norm (``ffn_norm``, when the MoE layer sits in a block), the shared
    expert, the router (z-loss and aux-loss attachment, expert-bias counts and the logged-loss
    statistics included: they are device-side updates of the router's buffers, replayed with the
    graph) and the routing-map padding of ``router_padding_alignment``.
``moe_preprocess``
    extends the ``moe_router`` graph with the dispatch preprocessing of the local dispatcher:
    the expert-major row order of the routed (token, expert) pairs and their probabilities
    (:func:`~lightning_moe.layers.permute.expert_order`). Legal exactly when the number of routed
    rows is known without reading the device, i.e. when no host read happens inside the scope:

    * the layer uses the local (single-device, EP = 1) dispatcher, whose ``dispatch`` is
      ``routed_row_counts`` + ``expert_order``; the EP dispatchers (``alltoall``,
      ``allgather``) exchange and read split sizes on the host inside ``dispatch`` and cannot be
      split at this point;
    * and the row count is static: ``T * top_k`` in dropless routing (top-k selects exactly K
      distinct experts per token) or ``capacity * E`` in drop-and-pad mode. Capacity dropping
      without padding and ``router_padding_alignment`` make it data-dependent: refused.

    In dropless mode the per-expert counts stay a device tensor after the graph, as in eager mode
    (the ``grouped_mm`` kernel reads nothing, the loop kernel reads them); in drop-and-pad mode
    they are static.
``moe``
    the whole MoE feed-forward (``x + moe(ffn_norm(x))``): only with static shapes, i.e.
    drop-and-pad (``capacity_factor`` set and ``pad_to_capacity=True``) and the local
    dispatcher. Dropless layers keep dispatch, experts and combine eager (use ``moe_router`` +
    ``moe_preprocess``). ``moe`` and ``moe_router`` are mutually exclusive (``moe`` contains it).

Rules shared by every scope that contains the router: its statistics must not need a collective
inside the graph (TP x CP > 1 with ``aux_loss``/``seq_aux_loss``, or TP x DP x CP > 1 with
``global_aux_loss``), and no parameter inside a scope may be a DTensor (tensor parallelism would
put its collectives into the graph). Both are refused with the reason: capturing NCCL collectives
is not supported by ``lightning_moe.graphs`` yet. Activation offload and selective recompute
(``lightning_moe.memory``) of a module inside a scope are refused too (host buffers, side streams
and Python-side bookkeeping that a replay would not repeat); ``moe_act`` recompute, a flag of the
expert kernel, is allowed.

Which modules a scope finds: *blocks* are the modules a model declares in its plan
(``parallel_plan().graph_blocks``, :mod:`lightning_moe.parallel.model_plan`; the reference
model's ``TransformerBlock`` s), each following
:class:`~lightning_moe.parallel.model_plan.GraphBlock`: its forward calls
``attention_residual`` and then ``ffn_residual`` (``x + ffn(ffn_norm(x), padding_mask)``), and the
capture replaces those two methods. ``attn`` finds blocks only (a model's undeclared attention is
not captured); the MoE scopes every ``lightning_moe.MoELayer``, inside a block (with its
``ffn_norm``) or bare in any model. :func:`missing_scopes` tells which scopes find nothing in a
model and what each looks for; :func:`find_targets` refuses them, ``CUDAGraphCapture`` skips
them with a warning (``strict=True`` raises).

The staged MoE forwards below compute exactly what ``ffn_residual`` and ``MoELayer.forward``
compute, split at the scope boundaries; ``tests/graphs`` checks them against the modules' own
forwards (outputs and every gradient) so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from lightning_moe.layers.dispatch import LocalDispatcher, LocalDispatchMetadata, routed_row_counts
from lightning_moe.layers.moe import MoELayer
from lightning_moe.layers.permute import expert_order, pad_routing_map
from lightning_moe.layers.routing import padded_expert_rows
from lightning_moe.memory.recompute import OFFLOAD_MARK, RECOMPUTE_MARK
from lightning_moe.parallel.model_plan import planned_modules, resolve

__all__ = [
    "SCOPES",
    "GraphTarget",
    "RouterOutputs",
    "attention_modules",
    "check_memory_features",
    "check_moe_layer",
    "experts_forward",
    "find_targets",
    "graph_blocks",
    "missing_scopes",
    "router_forward",
    "static_routed_rows",
    "validate_scopes",
]

SCOPES = ("attn", "moe_router", "moe_preprocess", "moe")
"""Every scope name, in the order the parts run inside a layer."""

_MOE_SCOPES = ("moe_router", "moe_preprocess", "moe")


def validate_scopes(scopes: str | Iterable[str]) -> tuple[str, ...]:
    """Check a list of scope names on its own (no model needed); returns them in canonical order.

    Raises ``ValueError`` for an empty list, unknown or repeated names, ``moe`` together with
    ``moe_router`` and ``moe_preprocess`` without ``moe_router``.
    """
    names = [scopes] if isinstance(scopes, str) else list(scopes)
    if not names:
        raise ValueError(f"Give at least one CUDA-graph scope, from {list(SCOPES)}.")
    unknown = [name for name in names if name not in SCOPES]
    if unknown:
        raise ValueError(f"Unknown CUDA-graph scope(s) {unknown}; choose from {list(SCOPES)}.")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"CUDA-graph scope(s) {repeated} given more than once: {names}.")
    if "moe" in names and "moe_router" in names:
        raise ValueError(
            "Scope 'moe' cannot be combined with scope 'moe_router': 'moe' already captures the router "
            "inside the whole MoE layer. Keep 'moe' (drop-and-pad layers) or 'moe_router' (any layer)."
        )
    if "moe_preprocess" in names and "moe_router" not in names:
        raise ValueError(
            "Scope 'moe_preprocess' extends the 'moe_router' graph (the dispatch preprocessing consumes "
            "the router outputs inside the same graph); add 'moe_router' to the scopes."
        )
    return tuple(name for name in SCOPES if name in names)


def static_routed_rows(config, num_tokens: int) -> int | None:
    """Rows the local dispatcher produces for ``num_tokens`` tokens, when known without a device read.

    ``capacity * E`` in drop-and-pad mode, ``T * top_k`` in dropless routing without
    routing-map padding; None otherwise (capacity dropping, ``router_padding_alignment``).
    """
    if config.pad_to_capacity:
        rows = padded_expert_rows(num_tokens, config.top_k, config.num_experts, config.capacity_factor)
        return rows * config.num_experts
    if config.capacity_factor is None and config.router_padding_alignment is None:
        return num_tokens * config.top_k
    return None


def _mode(config) -> str:
    if config.capacity_factor is None:
        return "dropless"
    return "drop-and-pad" if config.pad_to_capacity else "capacity dropping without padding"


def _is_dtensor(param: Tensor) -> bool:
    return hasattr(param, "placements") and hasattr(param, "device_mesh")


def check_no_dtensor(scope: str, name: str, modules: Sequence[nn.Module]) -> None:
    """Refuse tensor-parallel (DTensor) parameters inside a scope: their collectives would be captured."""
    for module in modules:
        for pname, param in module.named_parameters():
            if _is_dtensor(param):
                raise ValueError(
                    f"Scope {scope!r} on {name}: parameter {pname!r} is a DTensor (tensor parallelism), whose "
                    "collectives would run inside the CUDA graph; capturing collectives is not supported by "
                    f"lightning_moe.graphs yet. Use tensor_parallel_size=1 or drop {scope!r} from the scopes."
                )


def check_memory_features(scope: str, target: GraphTarget) -> None:
    """Refuse activation offload and (standard or output-discarding) recompute inside a scope."""
    inside = {id(m) for module in scope_modules(target, scope) for m in module.modules()}
    for inner_name, inner in target.module.named_modules():
        if id(inner) not in inside:
            continue
        offload, recompute = getattr(inner, OFFLOAD_MARK, None), getattr(inner, RECOMPUTE_MARK, None)
        if offload is not None:
            feature = f"activation offload {offload!r}"
        elif recompute not in (None, "moe_act"):
            feature = f"selective recompute {recompute!r}"
        else:
            continue
        where = ".".join(part for part in (target.name, inner_name) if part) or type(inner).__name__
        raise ValueError(
            f"Scope {scope!r} on {target.name or 'the model'}: {feature} is applied to {where}, inside the "
            "captured part. A CUDA graph replays fixed kernels on fixed memory and would not repeat their "
            f"host-side work; drop {scope!r} from the scopes or that module from ActivationOffload / "
            "SelectiveRecompute."
        )


def check_moe_layer(layer: MoELayer, scopes: Sequence[str], name: str = "MoELayer") -> None:
    """Every reason ``scopes`` cannot be captured on ``layer``; raises ``ValueError`` naming scope and fix."""
    config, dispatcher = layer.config, layer.dispatcher
    kind = type(dispatcher).__name__
    if "moe" in scopes:
        if not config.pad_to_capacity:
            raise ValueError(
                f"Scope 'moe' on {name}: the whole MoE layer can only be captured with static shapes "
                f"(drop-and-pad), but this layer uses {_mode(config)} routing, whose per-expert token counts "
                "are read from the device every step. Use scopes ['moe_router', 'moe_preprocess'] (dispatch, "
                "experts and combine stay eager) or set MoEConfig(capacity_factor=..., pad_to_capacity=True)."
            )
        if not isinstance(dispatcher, LocalDispatcher):
            raise ValueError(
                f"Scope 'moe' on {name}: the {kind} dispatcher runs collectives and host-side bookkeeping "
                "inside dispatch() (token-count exchange, host split sizes), which cannot be captured. Whole-"
                "layer graphs need the local dispatcher (expert_parallel_size=1); use 'moe_router' instead."
            )
    if "moe_preprocess" in scopes:
        if not isinstance(dispatcher, LocalDispatcher):
            raise ValueError(
                f"Scope 'moe_preprocess' on {name}: the {kind} dispatcher synchronises with the host inside "
                "dispatch() (it reads the exchanged token counts with .tolist() to size its all-to-all), so "
                "its preprocessing cannot be split off into the graph. Keep 'moe_router' only, or use the "
                "local dispatcher (expert_parallel_size=1)."
            )
        if config.router_padding_alignment is not None:
            raise ValueError(
                f"Scope 'moe_preprocess' on {name}: with router_padding_alignment="
                f"{config.router_padding_alignment} the number of routed rows depends on the routing (filler "
                "rows are added per expert), so the permutation would need a host read inside the graph. "
                "Keep 'moe_router' only, or turn router_padding_alignment off."
            )
        if config.capacity_factor is not None and not config.pad_to_capacity:
            raise ValueError(
                f"Scope 'moe_preprocess' on {name}: capacity dropping without pad_to_capacity keeps a "
                "data-dependent number of rows, so the permutation would need a host read inside the graph. "
                "Set pad_to_capacity=True, use dropless routing, or keep 'moe_router' only."
            )
    if any(scope in scopes for scope in ("moe_router", "moe")):
        scope = "moe" if "moe" in scopes else "moe_router"
        reduction = layer.router.reduction
        coeffs = {kind for kind, coeff in config.aux_loss_coeffs.items() if coeff > 0}
        if coeffs & {"aux_loss", "seq_aux_loss"} and reduction.tp_cp_size > 1:
            raise ValueError(
                f"Scope {scope!r} on {name}: the router sums its aux-loss counts over TP x CP "
                f"({reduction.tp_cp_size} ranks) with an all-reduce, which would be captured; capturing "
                "collectives is not supported by lightning_moe.graphs yet. Drop the router from the scopes "
                "(keep 'attn') or use TP = CP = 1."
            )
        if "global_aux_loss" in coeffs and reduction.tp_dp_cp_size > 1:
            raise ValueError(
                f"Scope {scope!r} on {name}: global_aux_loss sums its counts over TP x DP x CP "
                f"({reduction.tp_dp_cp_size} ranks) with an all-reduce, which would be captured; capturing "
                "collectives is not supported by lightning_moe.graphs yet. Use aux_loss / seq_aux_loss, or "
                "drop the router from the scopes."
            )


@dataclass(frozen=True)
class GraphTarget:
    """One module whose forward is staged: a declared block, or an MoE layer outside one."""

    name: str
    """Qualified module name."""
    module: nn.Module
    """The block (:class:`~lightning_moe.parallel.model_plan.GraphBlock`) or bare ``MoELayer``."""
    scopes: tuple[str, ...]
    """Scopes that apply to this module (``attn`` only on blocks, MoE scopes only with an MoE layer)."""

    @property
    def is_block(self) -> bool:
        """Whether :attr:`module` is a block (else a bare ``MoELayer``)."""
        return not isinstance(self.module, MoELayer)

    @property
    def moe(self) -> MoELayer | None:
        """The MoE layer this target stages, if any."""
        if isinstance(self.module, MoELayer):
            return self.module
        ffn = getattr(self.module, "ffn", None)
        return ffn if isinstance(ffn, MoELayer) else None


_LOOKS_FOR = {
    "attn": (
        "it captures the attention_residual of the blocks a model declares in parallel_plan().graph_blocks "
        "(lightning_moe.models.TransformerBlock modules in the reference model: x + attn(attn_norm(x))); a "
        "model's undeclared attention modules are not captured"
    ),
    "moe_router": "it captures the router (and shared expert) of lightning_moe.MoELayer modules",
    "moe_preprocess": "it captures the dispatch preprocessing of lightning_moe.MoELayer modules",
    "moe": "it captures whole lightning_moe.MoELayer modules",
}


def missing_scopes(model: nn.Module, scopes: str | Iterable[str]) -> dict[str, str]:
    """The (validated) ``scopes`` that find nothing to capture in ``model``, each with what it looks for.

    ``attn`` needs a declared block (:func:`graph_blocks`); the MoE scopes need an ``MoELayer``
    (any, bare or in a block). Returned in canonical scope order; empty when every scope finds something.
    """
    scopes = validate_scopes(scopes)
    has_block = bool(graph_blocks(model))
    has_moe = any(isinstance(module, MoELayer) for module in model.modules())
    found = {"attn": has_block, "moe_router": has_moe, "moe_preprocess": has_moe, "moe": has_moe}
    return {scope: _LOOKS_FOR[scope] for scope in scopes if not found[scope]}


def graph_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, block)`` of every block the plans inside ``model`` declare (``graph_blocks``)."""
    found = []
    for prefix, owner, plan in planned_modules(model):
        for name in plan.graph_blocks:
            block = resolve(owner, name)
            if block is not None:
                found.append((f"{prefix}.{name}" if prefix else name, block))
    return found


def attention_modules(block: nn.Module) -> list[nn.Module]:
    """The children of ``block`` its ``attention_residual`` uses: all but ``ffn_norm`` and ``ffn``."""
    ffn_side = {id(block.ffn), id(getattr(block, "ffn_norm", None))}
    return [child for child in block.children() if id(child) not in ffn_side]


def find_targets(model: nn.Module, scopes: Sequence[str]) -> list[GraphTarget]:
    """The modules of ``model`` the (validated) ``scopes`` apply to, after checking every rule.

    Declared blocks (:func:`graph_blocks`) take every scope (MoE scopes only where their
    ``ffn`` is an ``MoELayer``); an ``MoELayer`` outside such a block takes the MoE scopes (no
    norm is captured then: it is the caller's). Raises ``ValueError`` when a scope finds nothing
    to capture (drop it, see :func:`missing_scopes`) or is illegal on some layer (see the module
    docstring).
    """
    scopes = validate_scopes(scopes)
    missing = missing_scopes(model, scopes)
    if "attn" in missing:
        raise ValueError(
            "Scope 'attn' found no block in the model: attention graphs are defined for the blocks a model "
            "declares in parallel_plan().graph_blocks (lightning_moe.parallel.model_plan; the reference "
            "model's lightning_moe.models.TransformerBlock s). Drop 'attn' or declare the blocks."
        )
    if missing:
        raise ValueError(f"Scope(s) {list(missing)} found no MoELayer in the model; drop them.")
    blocks = graph_blocks(model)
    in_blocks = {id(block.ffn) for _, block in blocks}
    bare = [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer) and id(m) not in in_blocks]
    moe_scopes = tuple(s for s in scopes if s in _MOE_SCOPES)
    targets: list[GraphTarget] = []
    for name, block in blocks:
        own = tuple(s for s in scopes if s == "attn" or isinstance(block.ffn, MoELayer))
        if own:
            targets.append(GraphTarget(name, block, own))
    targets += [GraphTarget(name, layer, moe_scopes) for name, layer in bare if moe_scopes]
    for target in targets:
        if target.moe is not None:
            check_moe_layer(target.moe, target.scopes, target.name or "the model")
        for scope in target.scopes:
            check_no_dtensor(scope, target.name or "the model", scope_modules(target, scope))
            check_memory_features(scope, target)
    return targets


def scope_modules(target: GraphTarget, scope: str) -> list[nn.Module]:
    """The modules whose parameters and buffers the graph of ``scope`` on ``target`` uses."""
    module, moe = target.module, target.moe
    norm = [module.ffn_norm] if target.is_block and module.ffn_norm is not None else []
    if scope == "attn":
        return attention_modules(module)
    if scope == "moe":
        return [*norm, moe]
    shared = [moe.shared_expert] if moe.shared_expert is not None else []
    return [*norm, *shared, moe.router]


# ------------------------------------------------------------------------------ staged forwards


@dataclass
class RouterOutputs:
    """What the ``moe_router`` (+ ``moe_preprocess``) part of an MoE layer hands to the eager rest."""

    tokens: Tensor
    """``[T, H]`` normalised tokens (the experts' input)."""
    probs: Tensor
    """``[T, E]`` routing probabilities (losses attached)."""
    routing_map: Tensor
    """``[T, E]`` bool routing map (padded to ``router_padding_alignment`` when set)."""
    shared_out: Tensor | None
    """``[T, H]`` shared-expert output, or None."""
    row_index: Tensor | None = None
    """With ``moe_preprocess``: token index of every expert-major row."""
    row_probs: Tensor | None = None
    """With ``moe_preprocess``: probability of every expert-major row."""

    def as_tuple(self) -> tuple[Tensor | None, ...]:
        return (self.tokens, self.probs, self.routing_map, self.shared_out, self.row_index, self.row_probs)


def router_forward(
    layer: MoELayer,
    hidden: Tensor,
    padding_mask: Tensor | None,
    norm: nn.Module | None = None,
    preprocess: bool = False,
) -> RouterOutputs:
    """The ``moe_router`` scope (and ``moe_preprocess`` with ``preprocess=True``), as in ``MoELayer.forward``."""
    if norm is not None:
        hidden = norm(hidden)
    config = layer.config
    num_sequences = hidden.shape[0] if hidden.dim() == 3 else 1
    tokens = hidden.reshape(-1, hidden.shape[-1])
    mask = None if padding_mask is None else padding_mask.reshape(-1)
    shared_out = layer.shared_expert(tokens) if layer.shared_expert is not None else None
    probs, routing_map = layer.router(tokens, mask, num_sequences=num_sequences)
    if config.router_padding_alignment is not None:
        routing_map = pad_routing_map(routing_map, config.router_padding_alignment)
    outputs = RouterOutputs(tokens, probs, routing_map, shared_out)
    if preprocess:
        rows = static_routed_rows(config, tokens.shape[0])
        if rows is None:  # check_moe_layer refuses this configuration before anything is staged
            raise RuntimeError("moe_preprocess needs a static number of routed rows.")
        outputs.row_index, outputs.row_probs = expert_order(
            routing_map, probs, num_out_tokens=rows, drop_and_pad=config.pad_to_capacity
        )
    return outputs


def experts_forward(layer: MoELayer, routed: RouterOutputs) -> Tensor:
    """The eager rest of ``MoELayer.forward`` after the router: dispatch, experts, combine, shared add.

    Returns ``[T, H]``. After ``moe_preprocess`` the local dispatcher's work is already done: only
    its counts are taken (:func:`~lightning_moe.layers.dispatch.routed_row_counts`: static in
    drop-and-pad mode, a device tensor when dropless, as in eager mode).
    """
    if routed.row_index is None:
        rows, counts, row_probs, metadata = layer.dispatcher.dispatch(routed.tokens, routed.probs, routed.routing_map)
    else:
        rows, row_probs, metadata = routed.tokens, routed.row_probs, LocalDispatchMetadata(routed.row_index)
        counts, _ = routed_row_counts(routed.routing_map, layer.config)
    out = layer.dispatcher.combine(layer.run_experts(rows, counts, row_probs, metadata), metadata)
    if routed.shared_out is not None:
        out = out + routed.shared_out
    return out
