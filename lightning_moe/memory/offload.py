"""Fine-grained activation offload: saved activations of chosen module boundaries go to host memory.

Megatron Core's ``fine_grained_activation_offloading``. :func:`apply_activation_offload`
installs saved-tensor hooks at module boundaries of a built model; by default each name matches:

===============  ===================================  =================================================
name             boundary (reference model names)     tensors
===============  ===================================  =================================================
``attn_norm``    ``*.attn_norm``                      what the norm saves (its input, the rstd)
``qkv_linear``   ``*.attn.{q,k,v}_proj`` (one group)  their common input (the attention norm output)
``core_attn``    ``*.attn.core_attn``                 q, k, v, output and softmax statistics
``attn_proj``    ``*.attn.o_proj``                    its input
``mlp_norm``     ``*.ffn_norm``                       what the norm saves
``expert_fc1``   every ``GroupedExperts``             the expert input rows (fc1's input)
``moe_act``      every ``GroupedExperts``             the fc1 output and (unless ``moe_act`` is
                                                      recomputed) the activation output
===============  ===================================  =================================================

A user's own model names its own modules for the attention-side names (``attn_norm``,
``qkv_linear``, ``core_attn``, ``attn_proj``, ``mlp_norm``) with ``targets`` (module types or
qualified-name patterns, see :mod:`lightning_moe.memory.handles`), e.g.
``targets={"attn_norm": ["norm1"], "qkv_linear": ["attn.qkv"], "mlp_norm": ["blocks.*.norm2"]}``;
the ``targets`` of a name replace its default rule. ``qkv_linear`` targets that share a parent
module (separate q, k, v projections) form one boundary, as the reference model's do. The expert
names are found by the package's ``GroupedExperts`` type. Each module takes at most one boundary.
A name that matches nothing installs nothing (``strict=True`` raises instead).

Parameters, tensors of other devices, tensor subclasses and storages smaller than
``min_tensor_bytes`` stay where they are. How groups move (deferred copies on side streams, the
warm-up rule that keeps the last group of each name, one group of look-ahead in backward) is
described in :mod:`lightning_moe.memory.offloader`. Under pipeline parallelism
:meth:`OffloadHandle.start_microbatch_at` gives each stage's forward of each micro-batch its
own offload micro-batch.

Offloading inside a module that is recomputed with a standard checkpoint is refused (the
recomputed region keeps no activations; Megatron Core does not combine them either).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.memory.handles import (
    AppliedHandle,
    ModuleSpec,
    check_module_names,
    check_targets,
    describe_specs,
    find_modules,
)
from lightning_moe.memory.offloader import ActivationOffloader, OffloadStats, _Boundary
from lightning_moe.memory.recompute import _STANDARD, OFFLOAD_MARK, RECOMPUTE_MARK

__all__ = [
    "OFFLOAD_DEFAULT_TARGETS",
    "OFFLOAD_MODULES",
    "OFFLOAD_TARGETABLE",
    "ActivationOffloader",
    "OffloadHandle",
    "OffloadStats",
    "apply_activation_offload",
    "check_offload_modules",
    "check_offload_targets",
]

OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
"""Boundary names accepted by :func:`apply_activation_offload` (Megatron's ``offload_modules``)."""

_SUFFIXES = {  # the default rule of the names found by module name (reference model names)
    "attn_norm": ("attn_norm",),
    # Multi-head latent attention reads the block input through q_proj (or q_down_proj) and kv_down_proj.
    "qkv_linear": ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.q_down_proj", "attn.kv_down_proj"),
    "core_attn": ("attn.core_attn",),
    "attn_proj": ("attn.o_proj",),
    "mlp_norm": ("ffn_norm",),
}

OFFLOAD_TARGETABLE = tuple(_SUFFIXES)
"""Names whose modules a user's model can name itself (``targets``): those found by module name;
the expert names are found by type."""

OFFLOAD_DEFAULT_TARGETS = {
    "attn_norm": "modules named attn_norm",
    "qkv_linear": "the q_proj / k_proj / v_proj (MLA: q_proj or q_down_proj, kv_down_proj) of modules named attn",
    "core_attn": "modules named core_attn inside modules named attn",
    "attn_proj": "modules named o_proj inside modules named attn",
    "mlp_norm": "modules named ffn_norm",
    "expert_fc1": "lightning_moe GroupedExperts modules (the experts of every MoELayer)",
    "moe_act": "lightning_moe GroupedExperts modules (the experts of every MoELayer)",
}
"""What each name matches without ``targets`` (the text of the unmatched-name warning)."""

_EXPERT_KINDS = ("expert_fc1", "moe_act")


@dataclass
class OffloadHandle(AppliedHandle):
    """What :func:`apply_activation_offload` installed; :meth:`remove` undoes it (the offloader and
    its statistics stay usable). ``modules`` maps each requested name to its boundaries."""

    offloader: ActivationOffloader | None = None

    verb = "offloaded"
    customizable = OFFLOAD_TARGETABLE

    def start_microbatch_at(self, modules: Iterable[nn.Module]) -> None:
        """Start a new offload micro-batch at every forward of each of ``modules`` (undone by :meth:`remove`).

        For pipeline stages: a schedule runs a stage's forward once per micro-batch, several of them
        back to back (1F1B's warm-up, GPipe, interleaved virtual stages). With a forward pre-hook on
        each stage module every (micro-batch, stage) forward gets its own groups, warm-up rule and
        look-ahead, as Megatron Core offloads per micro-batch and virtual stage; otherwise the
        forwards would merge into one micro-batch and only the last one's groups stay on the device.
        """
        offloader = self.offloader
        if offloader is None:
            raise ValueError("This OffloadHandle has no offloader; use the handle apply_activation_offload returns.")

        def start(*_: object) -> None:
            offloader.start_microbatch()

        for module in modules:
            self._undo.append(module.register_forward_pre_hook(start).remove)


def check_offload_modules(modules: Sequence[str]) -> list[str]:
    """The names in ``modules`` without duplicates; ``ValueError`` naming the valid ones otherwise."""
    return check_module_names(modules, OFFLOAD_MODULES, "offload")


def check_offload_targets(
    targets: Mapping[str, ModuleSpec | Sequence[ModuleSpec]] | None, modules: Sequence[str]
) -> dict[str, tuple[ModuleSpec, ...]]:
    """``targets`` checked against the requested ``modules`` (see :func:`~lightning_moe.memory.handles.check_targets`)."""
    return check_targets(targets, modules, OFFLOAD_MODULES, OFFLOAD_TARGETABLE, "offload")


def _check_not_recomputed(model: nn.Module, name: str, boundary: str) -> None:
    parts = name.split(".") if name else []
    for depth in range(len(parts) + 1):
        prefix = ".".join(parts[:depth])
        module = model.get_submodule(prefix)
        kind = getattr(module, RECOMPUTE_MARK, None)
        if kind in _STANDARD:
            raise ValueError(
                f"Cannot offload {boundary!r} at {name}: it is inside {prefix or 'the model'}, which is "
                f"recomputed ({kind!r}) and keeps no activations to offload; drop one of the two "
                "(Megatron Core does not combine them either)."
            )


def _install(module: nn.Module, boundary: _Boundary, mark: str, name: str) -> Callable[[], None]:
    existing = getattr(module, OFFLOAD_MARK, None)
    if existing is not None:
        raise ValueError(
            f"{name or 'the model'} ({type(module).__name__}) already has an activation offload boundary "
            f"({existing!r}); cannot add {mark!r}: a module takes one boundary. Remove the earlier "
            "ActivationOffload first, or give targets that match each module under one name only."
        )
    handles = [
        module.register_forward_pre_hook(boundary.enter),
        module.register_forward_hook(boundary.exit, always_call=True),
    ]
    setattr(module, OFFLOAD_MARK, mark)

    def undo() -> None:
        for handle in handles:
            handle.remove()
        delattr(module, OFFLOAD_MARK)

    return undo


def apply_activation_offload(
    model: nn.Module,
    modules: Sequence[str],
    min_tensor_bytes: int = 1 << 20,
    offloader: ActivationOffloader | None = None,
    targets: Mapping[str, ModuleSpec | Sequence[ModuleSpec]] | None = None,
    strict: bool = False,
) -> OffloadHandle:
    """Offload the saved activations of the ``modules`` boundaries (names of :data:`OFFLOAD_MODULES`).

    ``targets`` names a user's own modules for the attention-side names: a list of module types
    or qualified-name patterns per name, replacing its default rule (module docstring). A name
    that matches no module is recorded with an empty list in ``handle.modules``
    (``handle.unmatched_message`` explains it), or raises ``ValueError`` with ``strict=True``
    before anything is installed. The offloader's device defaults to that of the model's first
    parameter. Raises ``ValueError`` for unknown names or targets, for a module given two
    boundaries, and for boundaries inside a module recomputed with a standard checkpoint
    (``moe``, ``attention``, ...).
    """
    kinds = check_offload_modules(modules)
    custom = check_offload_targets(targets, kinds)
    expert_kinds = [kind for kind in kinds if kind in _EXPERT_KINDS]
    experts = [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedExperts)] if expert_kinds else []
    found = {kind: find_modules(model, custom.get(kind, _SUFFIXES[kind])) for kind in kinds if kind in _SUFFIXES}
    if offloader is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else None
        offloader = ActivationOffloader(device, min_tensor_bytes)
    handle = OffloadHandle(offloader=offloader)
    for kind in kinds:
        matched = [name for name, _ in found.get(kind, experts)]
        if kind == "qkv_linear":  # q, k and v of one parent are one boundary
            matched = list(dict.fromkeys(_qkv_key(name) for name in matched))
        handle.modules[kind] = matched
        handle.looked_for[kind] = describe_specs(custom[kind]) if kind in custom else OFFLOAD_DEFAULT_TARGETS[kind]
    handle.check_unmatched("apply_activation_offload", type(model).__name__, strict)  # before anything is changed
    try:
        for name, module in experts:
            for kind in expert_kinds:
                _check_not_recomputed(model, name, kind)
            boundary = offloader.boundary(name, "moe_act" if "moe_act" in expert_kinds else None, expert_kinds)
            handle._undo.append(_install(module, boundary, "+".join(expert_kinds), name))
            handle._undo.append(_set_tagger(module, boundary.tag))
        for kind, matches in found.items():
            for name, module in matches:
                _check_not_recomputed(model, name, kind)
                key = _qkv_key(name) if kind == "qkv_linear" else name
                handle._undo.append(_install(module, offloader.boundary(key, kind), kind, name))
    except Exception:
        handle.remove()
        raise
    return handle


def _qkv_key(name: str) -> str:
    return (name.rsplit(".", 1)[0] + "." if "." in name else "") + "qkv_linear"


def _set_tagger(experts: GroupedExperts, tag: Callable) -> Callable[[], None]:
    previous = experts.saved_tensor_tagger
    experts.saved_tensor_tagger = tag

    def undo() -> None:
        experts.saved_tensor_tagger = previous

    return undo
