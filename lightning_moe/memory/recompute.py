"""Selective (fine-grained) activation recompute, Megatron Core's ``recompute_modules``.

:func:`apply_selective_recompute` changes modules of a built model in place (and
:class:`RecomputeHandle.remove` undoes it). By default each name matches:

==================  ==========================================  ====================================
name                modules                                     how
==================  ==========================================  ====================================
``moe_act``         every ``GroupedExperts``                    output discarding, inside the expert
                                                                kernel: the activation output
                                                                (``N x F``) is recomputed from the
                                                                kept fc1 output
``layernorm``       declared by the model's plan, else          output discarding (below)
                    ``*.attn_norm``, ``*.ffn_norm``
``shared_experts``  ``MoELayer.shared_expert``                  standard checkpoint
``router``          ``MoELayer.router``                         standard checkpoint
``core_attn``       declared by the model's plan                standard checkpoint
``attention``       declared by the model's plan                standard checkpoint
``moe``             every ``MoELayer`` (dispatch included)      standard checkpoint
==================  ==========================================  ====================================

``layernorm``, ``core_attn`` and ``attention`` are the model's own modules: a model declares them
in its plan (``parallel_plan().recompute``, :mod:`lightning_moe.parallel.model_plan`; the
reference model declares its ``attn_norm`` / ``ffn_norm``, ``CoreAttention`` and ``Attention`` /
MLA modules), and a caller names them with ``targets`` (module types or qualified-name patterns,
see :mod:`lightning_moe.memory.handles`), e.g.
``targets={"layernorm": [torch.nn.LayerNorm], "attention": ["blocks.*.attn"]}``; the ``targets``
of a name replace its default rule. The other names are found by the package's MoE layer types.
A name that matches nothing changes nothing (``strict=True`` raises instead).

Standard checkpoint: ``torch.utils.checkpoint`` (non-reentrant) around the module's ``forward``,
installed as an instance attribute, so ``module(x)`` still runs the module's forward hooks
(tensor parallelism puts its input/output conversions there) outside the recomputed region.

Side effects once per micro-batch: the non-reentrant checkpoint recomputes with grad enabled, so a router's ``self.training and torch.is_grad_enabled()`` guard does not
stop the recomputation from counting tokens and logging losses a second time. The checkpoint
therefore snapshots the module's buffers when the forward starts and, while recomputing, puts
the buffers back to that snapshot (the recomputation sees exactly the state the forward saw,
so e.g. the global aux loss's running counts give the same value) and afterwards restores what
they held before the recomputation (the dispatchers' host-side byte counters likewise). Counts, logged losses and metric statistics are recorded
exactly once, during the forward, where the consumers read them.

Output discarding (Megatron's ``CheckpointWithoutOutput``): the norm runs without saving its
own intermediates and keeps only its input; the tensors the following layers save *as their
input* (the norm output, which those layers would otherwise keep) are replaced by a reference
to the recomputation while the enclosing module (the norm's parent by qualified name, e.g. the
transformer block) runs, so the output's memory is released when that module's forward returns. In backward the first layer that needs the
output recomputes it (once, with grad), and the norm's backward reuses that recomputation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_moe.compat import tensor_version
from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.layers.moe import MoELayer
from lightning_moe.layers.router import TopKRouter
from lightning_moe.memory.handles import (
    AppliedHandle,
    ModuleSpec,
    check_module_names,
    check_targets,
    declared_modules,
    describe_specs,
    find_modules,
)
from lightning_moe.memory.saved_tensors import NOT_HANDLED, chained_saved_tensors_hooks, storage_of

__all__ = [
    "RECOMPUTE_DEFAULT_TARGETS",
    "RECOMPUTE_MODULES",
    "RECOMPUTE_TARGETABLE",
    "RecomputeHandle",
    "apply_selective_recompute",
    "check_recompute_modules",
    "check_recompute_targets",
    "checkpoint_module",
    "discard_output",
]

RECOMPUTE_MODULES = ("moe_act", "layernorm", "shared_experts", "router", "core_attn", "attention", "moe")
"""Names accepted by :func:`apply_selective_recompute` (Megatron's ``recompute_modules``)."""

RECOMPUTE_TARGETABLE = ("layernorm", "core_attn", "attention")
"""Names whose modules a user's model can name itself (``targets``); the rest are the package's MoE layers."""

RECOMPUTE_DEFAULT_TARGETS = {
    "moe_act": "lightning_moe GroupedExperts modules (the experts of every MoELayer)",
    "layernorm": (
        "norms named attn_norm / ffn_norm, or the norms a model's parallel_plan() declares (recompute['layernorm'])"
    ),
    "shared_experts": "the shared_expert of MoELayers built with shared_expert_ffn_hidden_size",
    "router": "lightning_moe TopKRouter modules (MoELayer.router)",
    "core_attn": (
        "the core-attention modules a model's parallel_plan() declares (recompute['core_attn']; the reference "
        "model's CoreAttention)"
    ),
    "attention": (
        "the attention modules a model's parallel_plan() declares (recompute['attention']; the reference "
        "model's Attention and MultiLatentAttention)"
    ),
    "moe": "lightning_moe.MoELayer modules",
}
"""What each name matches without ``targets`` (the text of the unmatched-name warning)."""

_NORM_NAMES = ("attn_norm", "ffn_norm")
_STANDARD = ("shared_experts", "router", "core_attn", "attention", "moe")
RECOMPUTE_MARK = "_lightning_moe_recompute"
"""Instance attribute naming the standard checkpoint applied to a module (offload checks it)."""
OFFLOAD_MARK = "_lightning_moe_offload"
"""Instance attribute naming the offload boundary installed on a module (recompute checks it)."""


def _wrap_forward(module: nn.Module, make: Callable[[Callable], Callable]) -> Callable[[], None]:
    """Replace ``module.forward`` by ``make(current forward)``; returns the undo function."""
    previous = module.__dict__.get("forward")
    wrapper = make(module.forward)
    module.forward = wrapper

    def undo() -> None:
        if module.__dict__.get("forward") is not wrapper:
            raise RuntimeError(
                f"{type(module).__name__}.forward was wrapped again after recompute was applied; "
                "remove the later wrappers first."
            )
        if previous is None:
            del module.forward
        else:
            module.forward = previous

    return undo


# --------------------------------------------------------------------------- standard checkpoint


class _HoldInputs(torch.autograd.Function):
    """Identity that saves its inputs: makes the tensors a checkpoint keeps visible to saved-tensor
    hooks (byte counters), at no memory cost (the checkpoint holds them anyway)."""

    @staticmethod
    def forward(ctx, *tensors):
        ctx.save_for_backward(*tensors)
        outputs = tuple(t.view_as(t) for t in tensors)
        ctx.mark_non_differentiable(*(o for o, t in zip(outputs, tensors) if not t.requires_grad))
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        return grads


def _hold_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    flat = list(args) + list(kwargs.values())
    positions = [i for i, value in enumerate(flat) if isinstance(value, Tensor)]
    if not positions:
        return args, kwargs
    held = _HoldInputs.apply(*(flat[i] for i in positions))
    for i, tensor in zip(positions, held):
        flat[i] = tensor
    return tuple(flat[: len(args)]), dict(zip(kwargs, flat[len(args) :]))


class _RestoreBuffers:
    """While recomputing: buffers as they were when the forward began; afterwards as before.

    Host-side counters of the dispatchers (``dispatcher.stats``, a dataclass of byte and row
    counts) are put back after the recomputation too: its communication is a replay, not a
    second dispatch of the micro-batch.
    """

    def __init__(self, snapshot: list[tuple[Tensor, int, Tensor]], counters: list[object]) -> None:
        self._snapshot = snapshot
        self._counters = counters
        self._active: list[list[tuple[Tensor, int, Tensor]]] = []
        self._active_counters: list[list[tuple[object, dict]]] = []

    def __enter__(self) -> None:
        self._active_counters.append([(c, dict(vars(c))) for c in self._counters])
        entered = []
        with torch.no_grad():
            for buffer, version_at_forward, value_at_forward in self._snapshot:
                entered.append((buffer, tensor_version(buffer), buffer.clone()))
                if tensor_version(buffer) != version_at_forward:
                    buffer.copy_(value_at_forward)
        self._active.append(entered)

    def __exit__(self, *args: object) -> None:
        with torch.no_grad():
            for buffer, version_at_enter, value_at_enter in self._active.pop():
                if tensor_version(buffer) != version_at_enter:
                    buffer.copy_(value_at_enter)
        for counters, values in self._active_counters.pop():
            vars(counters).update(values)


def _dispatch_counters(module: nn.Module) -> list[object]:
    found = []
    for inner in module.modules():
        stats = getattr(getattr(inner, "dispatcher", None), "stats", None)
        if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
            found.append(stats)
    return found


def _side_effect_contexts(module: nn.Module) -> Callable[[], tuple]:
    def context_fn() -> tuple:
        # Called by checkpoint when the forward starts: snapshot every buffer (a few [E] tensors).
        snapshot = [(b, tensor_version(b), b.detach().clone()) for b in module.buffers()]
        return contextlib.nullcontext(), _RestoreBuffers(snapshot, _dispatch_counters(module))

    return context_fn


def checkpoint_module(module: nn.Module) -> Callable[[], None]:
    """Recompute ``module``'s forward in backward instead of keeping its intermediates.

    Non-reentrant ``torch.utils.checkpoint`` (RNG state preserved, so router jitter recomputes
    identically) around the module's current ``forward``; buffer updates of the forward happen
    once (see the module docstring). Without grad (evaluation) the forward runs as is. Returns a
    function that restores the previous ``forward``.
    """
    contexts = _side_effect_contexts(module)

    def make(original: Callable) -> Callable:
        def forward(*args, **kwargs):
            if not torch.is_grad_enabled():
                return original(*args, **kwargs)
            args, kwargs = _hold_inputs(args, kwargs)
            return checkpoint(original, *args, use_reentrant=False, context_fn=contexts, **kwargs)

        return forward

    return _wrap_forward(module, make)


# ------------------------------------------------------------------------------ output discarding


def _autocast_context(device_type: str) -> contextlib.AbstractContextManager:
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type))


class _DiscardState:
    """One call of an output-discarding module: its input, and the recomputation once done."""

    def __init__(self, fn: Callable[[Tensor], Tensor], params: list[Tensor]) -> None:
        self.fn, self.params = fn, params
        self.input: Tensor | None = None
        self.output_storage: weakref.ref | None = None
        self.recomputed: tuple[Tensor, Tensor] | None = None
        self.autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def recompute(self) -> tuple[Tensor, Tensor]:
        """``(detached input, output with its graph)``, computed on first use."""
        if self.recomputed is None:
            detached = self.input.detach().requires_grad_(self.input.requires_grad)
            with torch.enable_grad(), self.autocast():
                self.recomputed = (detached, self.fn(detached))
        return self.recomputed


class _OutputDiscardingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state, x, *params):
        with torch.no_grad():
            out = state.fn(x)
        ctx.save_for_backward(x)  # what the norm keeps (the recomputation reads state.input, the same tensor)
        ctx.state = state
        state.input = x
        return out

    @staticmethod
    def backward(ctx, grad_out):
        state = ctx.state
        detached, out = state.recompute()
        needs = ctx.needs_input_grad[1:]
        inputs = [detached, *state.params]
        chosen = [t for t, need in zip(inputs, needs) if need]
        grads = iter(torch.autograd.grad(out, chosen, grad_out, allow_unused=True) if chosen else ())
        state.recomputed = None
        return (None, *(next(grads) if need else None for need in needs))


@dataclass
class _Token:
    """Stands for a view of a discarded output in a consumer's saved tensors."""

    state: _DiscardState
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _DiscardScope:
    """Forward hooks on the enclosing module: while it runs, saved views of discarded outputs become tokens."""

    def __init__(self, module: nn.Module) -> None:
        self.frames: list[list[_DiscardState]] = []
        self._hooks: list = []
        self.users = 0
        self.handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self.frames.append([])
        hooks = chained_saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)

    def _exit(self, module: nn.Module, args: tuple, output: object) -> None:
        self._hooks.pop().__exit__(None, None, None)
        self.frames.pop()

    def _pack(self, tensor: Tensor) -> object:
        states = self.frames[-1] if self.frames else ()
        if not states or type(tensor) is not Tensor:
            return NOT_HANDLED
        storage = storage_of(tensor)
        for state in states:
            if state.output_storage is not None and state.output_storage() is storage:
                return _Token(state, tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        return NOT_HANDLED

    @staticmethod
    def _unpack(token: _Token) -> Tensor:
        _, out = token.state.recompute()
        with torch.no_grad():
            view = torch.empty(0, dtype=token.dtype, device=out.device)
            return view.set_(out.untyped_storage(), token.offset, token.size, token.stride)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def discard_output(module: nn.Module, scope: _DiscardScope) -> Callable[[], None]:
    """Make ``module`` (one tensor in, a fresh tensor out, e.g. a norm) output-discarding within ``scope``.

    Returns the undo function. Outside a forward of the scope's module, or without grad, the
    module runs as before.
    """

    def make(original: Callable) -> Callable:
        def forward(*args, **kwargs):
            if not torch.is_grad_enabled() or not scope.frames or kwargs or len(args) != 1:
                return original(*args, **kwargs)
            # Read at each call: sharded data parallelism (FSDP2) registers the gathered parameters
            # for the forward only, and the gradient must reach those.
            params = list(module.parameters())
            state = _DiscardState(original, params)
            device_type = args[0].device.type
            state.autocast = lambda: _autocast_context(device_type)
            out = _OutputDiscardingFunction.apply(state, args[0], *params)
            storage = storage_of(out) if type(out) is Tensor else None
            if storage is not None:
                state.output_storage = weakref.ref(storage)
                scope.frames[-1].append(state)
            return out

        return forward

    return _wrap_forward(module, make)


# ---------------------------------------------------------------------------------- application


class RecomputeHandle(AppliedHandle):
    """What :func:`apply_selective_recompute` changed; :meth:`remove` restores every module."""

    verb = "recomputed"
    customizable = RECOMPUTE_TARGETABLE


def check_recompute_modules(modules: Sequence[str]) -> list[str]:
    """The names in ``modules`` without duplicates; ``ValueError`` naming the valid ones otherwise."""
    return check_module_names(modules, RECOMPUTE_MODULES, "recompute")


def check_recompute_targets(
    targets: Mapping[str, ModuleSpec | Sequence[ModuleSpec]] | None, modules: Sequence[str]
) -> dict[str, tuple[ModuleSpec, ...]]:
    """``targets`` checked against the requested ``modules`` (see :func:`~lightning_moe.memory.handles.check_targets`)."""
    return check_targets(targets, modules, RECOMPUTE_MODULES, RECOMPUTE_TARGETABLE, "recompute")


_TYPES = {"moe_act": GroupedExperts, "router": TopKRouter, "moe": MoELayer}


def _targets(model: nn.Module, kind: str, specs: tuple[ModuleSpec, ...] | None) -> list[tuple[str, nn.Module]]:
    if specs is not None:
        return find_modules(model, specs)
    if kind in RECOMPUTE_TARGETABLE:
        declared = declared_modules(model, kind)
        if declared is not None:
            return declared
        return find_modules(model, _NORM_NAMES) if kind == "layernorm" else []
    found = []
    for name, module in model.named_modules():
        if kind == "shared_experts":
            if isinstance(module, MoELayer) and module.shared_expert is not None:
                found.append((f"{name}.shared_expert" if name else "shared_expert", module.shared_expert))
        elif isinstance(module, _TYPES[kind]):
            found.append((name, module))
    return found


def _check_no_offload_inside(kind: str, name: str, module: nn.Module) -> None:
    for inner_name, inner in module.named_modules():
        boundary = getattr(inner, OFFLOAD_MARK, None)
        if boundary is not None:
            where = f"{name}.{inner_name}" if inner_name else name
            raise ValueError(
                f"Cannot recompute {kind!r} ({name}): activation offload {boundary!r} is installed inside it "
                f"({where}). A recomputed region keeps no activations to offload; drop one of the two "
                "(Megatron Core does not combine them either)."
            )


def apply_selective_recompute(
    model: nn.Module,
    modules: Sequence[str],
    targets: Mapping[str, ModuleSpec | Sequence[ModuleSpec]] | None = None,
    strict: bool = False,
) -> RecomputeHandle:
    """Apply fine-grained recompute of ``modules`` (names of :data:`RECOMPUTE_MODULES`) to ``model``.

    Works on any model with this package's ``MoELayer`` s, on the norms and attention modules the
    model's plan declares (``parallel_plan().recompute``) and on norms named ``attn_norm``/``ffn_norm``
    in a model that declares none; ``targets`` names a
    user's own modules for ``layernorm`` (any module taking one tensor and returning a fresh
    one), ``core_attn`` and ``attention`` (any module): a list of module types or qualified-name
    patterns per name, replacing its default rule (module docstring). A name that matches no
    module is recorded with an empty list in ``handle.modules`` (``handle.unmatched_message``
    explains it), or raises ``ValueError`` with ``strict=True`` before anything is changed.
    Raises ``ValueError`` for unknown names or targets, for a module already recomputed, and
    for a standard checkpoint around an activation offload boundary.
    """
    kinds = check_recompute_modules(modules)
    custom = check_recompute_targets(targets, kinds)
    handle = RecomputeHandle()
    found = {kind: _targets(model, kind, custom.get(kind)) for kind in kinds}
    for kind in kinds:
        handle.modules[kind] = [name for name, _ in found[kind]]
        handle.looked_for[kind] = describe_specs(custom[kind]) if kind in custom else RECOMPUTE_DEFAULT_TARGETS[kind]
    handle.check_unmatched("apply_selective_recompute", type(model).__name__, strict)  # before anything is changed
    scopes: dict[int, _DiscardScope] = {}
    try:
        for kind in kinds:
            for name, module in found[kind]:
                if getattr(module, RECOMPUTE_MARK, None) is not None:
                    fix = f", or give {kind!r} targets that do not match it" if kind in custom else ""
                    raise ValueError(
                        f"{name} is already recomputed ({getattr(module, RECOMPUTE_MARK)!r}); remove the "
                        f"earlier SelectiveRecompute / apply_selective_recompute first{fix}."
                    )
                if kind == "moe_act":
                    handle._undo.append(_force_activation_recompute(module))
                    continue
                if kind in _STANDARD:
                    _check_no_offload_inside(kind, name, module)
                    handle._undo.append(checkpoint_module(module))
                else:  # layernorm: outputs discarded while the norm's parent module runs
                    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
                    scope = scopes.get(id(parent))
                    if scope is None:
                        scope = scopes[id(parent)] = _DiscardScope(parent)
                        handle._undo.append(scope.remove)
                    handle._undo.append(discard_output(module, scope))
                setattr(module, RECOMPUTE_MARK, kind)
                handle._undo.append(lambda module=module: delattr(module, RECOMPUTE_MARK))
    except Exception:
        handle.remove()
        raise
    return handle


def _force_activation_recompute(experts: GroupedExperts) -> Callable[[], None]:
    previous = experts.recompute_activation
    experts.recompute_activation = True

    def undo() -> None:
        experts.recompute_activation = previous

    return undo
