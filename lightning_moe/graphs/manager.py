"""`CUDAGraphManager`: stage a model's layers by scope, record one training step, capture, replay.

Usage in a plain training loop (the Lightning callback ``CUDAGraphCapture`` does the same)::

    graphs = CUDAGraphManager(model, ["attn", "moe_router", "moe_preprocess"])
    for step, batch in enumerate(loader):
        if step == warmup_steps - 1:
            graphs.start_recording()          # this step runs eagerly and records every stage
        loss = model.loss(*batch); loss.backward(); optimizer.step(); optimizer.zero_grad()
        if graphs.recording:
            graphs.capture()                  # from the next step on, the stages replay

Building the manager checks every rule of :mod:`lightning_moe.graphs.scopes` and replaces, by
instance attributes that run the same computation split at the scope boundaries, the
``attention_residual`` and ``ffn_residual`` methods of each declared block
(:class:`~lightning_moe.parallel.model_plan.GraphBlock`: the block's own ``forward`` calls them,
so no copy of it exists here) and the ``forward`` of each ``MoELayer`` outside one; ``release()``
restores the modules' own methods (where another wrapper was installed on top in the meantime,
the staged method stays underneath it and runs the plain eager computation). State dicts and
parameters are untouched.

Stages are recorded in the order they run in the recorded step and captured in that order
(forward graphs), then in reverse (backward graphs), all into one memory pool: replays follow the
same order (forward layer by layer, backward in reverse), so sharing the pool is safe. One graph
per stage is held: at most one micro-batch may be in flight between a stage's forward and its
backward (sequential gradient accumulation is fine; pipeline schedules with several micro-batches
in flight, or activation recompute of a captured scope, are not).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_moe.graphs.cuda_graph import GraphedStage, make_backend
from lightning_moe.graphs.scopes import (
    GraphTarget,
    RouterOutputs,
    check_memory_features,
    experts_forward,
    find_targets,
    router_forward,
    scope_modules,
)
from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.layers.moe import MoELayer

__all__ = ["CUDAGraphManager"]


@dataclass
class _LayerStages:
    attn: GraphedStage | None = None
    router: GraphedStage | None = None
    moe: GraphedStage | None = None


def _invalid_moe_inputs(layer: MoELayer, hidden: Tensor, padding_mask: Tensor | None) -> bool:
    if hidden.dim() not in (2, 3) or hidden.shape[-1] != layer.config.hidden_size:
        return True
    return padding_mask is not None and padding_mask.shape != hidden.shape[:-1]


def _attention_residual(block: nn.Module, stages: _LayerStages, x, *args):
    """The block's ``attention_residual`` with the ``attn`` scope replaced by its stage."""
    if stages.attn is not None:
        (x,) = stages.attn(x, *args)
        return x
    return type(block).attention_residual(block, x, *args)


def _ffn_residual(block: nn.Module, stages: _LayerStages, x, padding_mask=None):
    """The block's ``ffn_residual`` (``x + ffn(ffn_norm(x), padding_mask)``) with its MoE scopes replaced by their stages."""
    eager = stages.moe is None and stages.router is None
    if eager or (isinstance(block.ffn, MoELayer) and _invalid_moe_inputs(block.ffn, x, padding_mask)):
        return type(block).ffn_residual(block, x, padding_mask)  # the MoE layer raises its own errors
    if stages.moe is not None:
        (out,) = stages.moe(x, padding_mask)
        return out
    routed = RouterOutputs(*stages.router(x, padding_mask))
    return x + experts_forward(block.ffn, routed).view(x.shape)


def _moe_forward(layer: MoELayer, stages: _LayerStages, hidden, padding_mask=None):
    """``MoELayer.forward`` with its scopes replaced by their stages."""
    if _invalid_moe_inputs(layer, hidden, padding_mask) or (stages.moe is None and stages.router is None):
        return MoELayer.forward(layer, hidden, padding_mask)
    if stages.moe is not None:
        (out,) = stages.moe(hidden, padding_mask)
        return out
    routed = RouterOutputs(*stages.router(hidden, padding_mask))
    return experts_forward(layer, routed).view(hidden.shape)


def _build_stages(target: GraphTarget) -> _LayerStages:
    module, moe, scopes = target.module, target.moe, target.scopes
    stages = _LayerStages()
    if "attn" in scopes:

        def attn(x, *args):
            return (type(module).attention_residual(module, x, *args),)

        stages.attn = GraphedStage(f"{target.name}.attn", attn, scope_modules(target, "attn"))
    if "moe" in scopes:
        if target.is_block:

            def whole(x, padding_mask):
                return (type(module).ffn_residual(module, x, padding_mask),)
        else:

            def whole(hidden, padding_mask):
                return (MoELayer.forward(moe, hidden, padding_mask),)

        stages.moe = GraphedStage(f"{target.name}.moe", whole, scope_modules(target, "moe"))
    elif "moe_router" in scopes:
        norm = module.ffn_norm if target.is_block else None
        preprocess = "moe_preprocess" in scopes

        def router(hidden, padding_mask):
            return router_forward(moe, hidden, padding_mask, norm=norm, preprocess=preprocess).as_tuple()

        name = "moe_router+moe_preprocess" if preprocess else "moe_router"
        stages.router = GraphedStage(f"{target.name}.{name}", router, scope_modules(target, "moe_router"))
    return stages


_STAGED = {True: (("attention_residual", _attention_residual), ("ffn_residual", _ffn_residual)),
           False: (("forward", _moe_forward),)}
"""The methods staged on a block (True) and on a bare MoE layer (False)."""


class CUDAGraphManager:
    """Per-layer partial CUDA graphs of ``model`` for ``scopes`` (see the module docstring).

    Args:
        model: any module containing declared blocks (``parallel_plan().graph_blocks``) and/or ``MoELayer`` s, after
            parallelisation and on its final device (parameters must not move afterwards).
        scopes: names from :data:`~lightning_moe.graphs.scopes.SCOPES`.
        num_warmup_iters: eager forward+backward runs of every stage on a side stream right before
            capture (cuBLAS/cuDNN lazy initialisation must not land in a graph).
        backend: ``cuda`` (real graphs) or ``emulate`` (same plumbing, no graphs: CPU tests).
        generators: extra ``torch.Generator`` s used inside the scopes, registered with every graph
            (the default CUDA generator is registered by PyTorch itself).
    """

    def __init__(
        self,
        model: nn.Module,
        scopes: Iterable[str],
        num_warmup_iters: int = 2,
        backend: str = "cuda",
        generators: Sequence[torch.Generator] = (),
    ) -> None:
        if num_warmup_iters < 0:
            raise ValueError(f"num_warmup_iters must be >= 0, got {num_warmup_iters}.")
        self.targets = find_targets(model, list(scopes))
        self.scopes = tuple(dict.fromkeys(s for t in self.targets for s in t.scopes))
        self.num_warmup_iters = num_warmup_iters
        self._backend = make_backend(backend, generators)
        self._stages: dict[str, _LayerStages] = {}
        self._recorded: list[GraphedStage] = []
        self.recording = False
        self._kernel_overrides = self._capturable_expert_kernels() if backend == "cuda" else []
        self._forwards: list[tuple[nn.Module, str, functools.partial]] = []
        for target in self.targets:
            stages = _build_stages(target)
            self._stages[target.name] = stages
            for method, fn in _STAGED[target.is_block]:
                staged = functools.partial(fn, target.module, stages)
                setattr(target.module, method, staged)
                self._forwards.append((target.module, method, staged))

    def _capturable_expert_kernels(self) -> list[tuple[GroupedExperts, str]]:
        # GroupedExperts' grouped_mm kernel builds its group offsets with torch.tensor(host list,
        # device=cuda): a synchronous host-to-device copy, illegal while capturing. Inside a whole-
        # layer ('moe') graph the per-expert loop kernel is used instead (its launches are replayed
        # from the graph, so their overhead is gone); release() restores the kernel.
        overrides = []
        for target in self.targets:
            experts = target.moe.experts if "moe" in target.scopes else None
            if type(experts) is GroupedExperts and experts.kernel != "loop":
                device = experts.fc1_weight.device
                if experts.resolved_kernel(device) == "grouped_mm":
                    warnings.warn(
                        f"CUDA graph scope 'moe' on {target.name}: the grouped_mm expert kernel copies its "
                        "offsets from the host, which cannot be captured; using the per-expert loop kernel "
                        "inside the graph.",
                        stacklevel=3,
                    )
                    overrides.append((experts, experts.kernel))
                    experts.kernel = "loop"
        return overrides

    @property
    def stages(self) -> list[GraphedStage]:
        """Every stage, in module order."""
        return [s for group in self._stages.values() for s in (group.attn, group.router, group.moe) if s is not None]

    @property
    def captured(self) -> bool:
        """Whether graphs have been captured (and not released)."""
        return any(stage.captured for stage in self.stages)

    def start_recording(self) -> None:
        """Record the next training forward: each stage's first call (signature, input copies, order)."""
        if self.captured:
            raise RuntimeError("CUDA graphs are already captured; call release() before recording again.")
        self._recorded = []
        self.recording = True
        for stage in self.stages:
            stage._recorder = self._record

    def _record(self, stage: GraphedStage, inputs: tuple) -> None:
        if stage not in self._recorded:
            stage.prepare(inputs)
            self._recorded.append(stage)

    def capture(self) -> list[str]:
        """Capture every recorded stage; returns their names in capture (forward) order.

        Buffers of the captured modules (router statistics) are restored in place afterwards, so
        warm-up and capture leave no trace in them; parameter gradients are not touched.
        """
        self.recording = False
        for stage in self.stages:
            stage._recorder = None
        order = list(self._recorded)
        if not order:
            raise RuntimeError(
                "No stage was recorded: call start_recording() before a training step (grad enabled, "
                "modules in training mode) and capture() after its backward."
            )
        for target in self.targets:  # offload / recompute may have been applied after staging
            for scope in target.scopes:
                check_memory_features(scope, target)
        buffers = {id(b): b for stage in order for m in stage.modules for b in m.buffers()}
        saved = [(b, b.detach().clone()) for b in buffers.values()]
        backend = self._backend
        with backend.warmup_stream():
            for stage in order:
                stage.warmup(self.num_warmup_iters)
        for stage in order:
            stage.capture_forward(backend)
        for stage in reversed(order):
            stage.capture_backward(backend)
        if backend.name == "cuda":
            torch.cuda.synchronize()
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
        self._recorded = []
        return [stage.name for stage in order]

    @contextlib.contextmanager
    def recording_step(self):
        """Record during the ``with`` block (one full training step) and capture at its end."""
        self.start_recording()
        try:
            yield self
        except BaseException:
            self.recording = False
            for stage in self.stages:
                stage._recorder = None
            raise
        self.capture()

    def release(self) -> None:
        """Drop every graph and restore the modules' own methods."""
        for stage in self.stages:
            stage._recorder = None
            stage.release()
        for stages in self._stages.values():  # a forward wrapped again later then runs plain eagerly
            stages.attn = stages.router = stages.moe = None
        for module, method, staged in self._forwards:
            if module.__dict__.get(method) is staged:
                delattr(module, method)
        self._forwards = []
        for experts, kernel in self._kernel_overrides:
            experts.kernel = kernel
        self._kernel_overrides = []
        self._stages = {}
        self.recording = False

    def stats(self) -> dict[str, dict[str, int]]:
        """Replays, eager calls and eager fallbacks of every stage, by stage name."""
        return {stage.name: stage.stats() for stage in self.stages}
