"""One captured part of a layer (`GraphedStage`): static buffers, capture, replay under autograd.

Why ``torch.cuda.CUDAGraph`` directly and not ``torch.cuda.make_graphed_callables``
------------------------------------------------------------------------------------
The machinery follows ``make_graphed_callables`` (static inputs, warm-up on a side stream, forward
graphs captured in execution order and backward graphs in reverse order into one shared memory
pool, an autograd function that copies inputs in, replays, and hands the static outputs out), but
is written on ``torch.cuda.CUDAGraph`` because ``make_graphed_callables``

* returns the weight gradients as aliases of the graph's static memory. ``AccumulateGrad``
  steals such a tensor into ``param.grad`` on the first backward, so the next backward replay
  overwrites ``param.grad`` before adding to it: with gradient accumulation the accumulated
  gradient becomes ``2 * g_last`` instead of ``g_1 + g_2`` (reproduced on CPU with the same
  autograd pattern). Here parameter gradients (and gradients of leaf inputs) are fresh tensors;
* runs the callables' side effects during its warm-up and capture (the router's aux-loss and
  expert-bias statistics, logged losses) with no way to undo them; here the buffers of the
  captured modules are snapshotted before and restored in place after capture;
* takes parameters only from a single ``nn.Module`` per callable and refuses modules with hooks,
  while a scope spans parts of several modules (norm, shared expert, router) that other
  callbacks may hook;
* captures from sample arguments outside the training step, where Lightning's autocast is not
  active; here the signature (shapes, dtypes, ``requires_grad``, autocast state) is recorded in a
  real training step and the capture re-enters the same autocast state, with its weight-cast
  cache disabled (a cached cast made outside the graph would be freed while the graph reads it).

Replay is used only when the call matches the captured signature, grad mode is on and the modules
are in training mode; anything else (validation, a last batch of another size) runs eagerly and is
counted in ``eager_fallbacks``. Parameters must not be reallocated after capture (replacing
``param.data``, ``.to()``): the graph reads their addresses, and a replay with moved parameters
raises ``RuntimeError``.

Random numbers: ``torch.cuda.graph`` registers the default CUDA generator with every capture
(graph-safe Philox: each replay advances the generator's offset, so replays draw fresh numbers,
e.g. for ``input_jitter_eps``). Other generators used inside a scope must be registered: pass them
as ``generators=`` (``CUDAGraph.register_generator_state``). Warm-up and capture consume random
offsets too, so a graphed run with random ops draws different noise than an eager run.

The ``emulate`` backend runs the same plumbing without CUDA graphs (each "replay" re-runs the
stage and copies its results into the static buffers): it is how the CPU tests verify staging,
buffer aliasing, gradient handling and side-effect restoration, and a debugging aid on GPUs.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["BACKENDS", "GraphedStage", "StageSignature", "make_backend"]

BACKENDS = ("cuda", "emulate")

StageSignature = tuple
"""Per input ``(shape, dtype, device, requires_grad)`` or None, then the autocast state."""


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype | None]:
    if device_type not in ("cuda", "cpu"):
        return (False, None)
    enabled = torch.is_autocast_enabled(device_type)
    return (enabled, torch.get_autocast_dtype(device_type) if enabled else None)


def signature_of(inputs: Sequence[Tensor | None]) -> StageSignature:
    """What a call must match to replay a graph captured from ``inputs``."""
    device = next((t.device.type for t in inputs if t is not None), "cpu")
    per_input = tuple(
        None if t is None else (tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in inputs
    )
    return (*per_input, _autocast_state(device))


class _CudaBackend:
    """Real CUDA graphs: one private memory pool shared by every stage of a manager."""

    name = "cuda"

    def __init__(self, generators: Sequence[torch.Generator] = ()) -> None:
        self.generators = tuple(generators)
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_stream = torch.cuda.Stream()

    def capture(self, run: Callable[[], Any]) -> tuple[Any, Any]:
        graph = torch.cuda.CUDAGraph()
        for generator in self.generators:
            graph.register_generator_state(generator)
        # thread_local: CUDA calls of other threads (data-loader pinning) must not abort the capture.
        with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream, capture_error_mode="thread_local"):
            result = run()
        return graph, result

    def replay(self, graph: Any) -> None:
        graph.replay()

    @contextlib.contextmanager
    def warmup_stream(self):
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()


class _EmulatedGraph:
    """Stands for a captured graph: replay re-runs the stage and writes into the static buffers."""

    def __init__(self, run: Callable[[], Any], static: Sequence[Tensor | None]) -> None:
        self.run = run
        self.static = static
        self.live: Any = None

    def replay(self) -> None:
        result = self.run()
        for target, value in zip(self.static, result):
            # An output that is a view of a static input already sits in the static memory.
            if target is not None and value is not None and target.data_ptr() != value.data_ptr():
                target.copy_(value.detach())
        self.live = result


class _EmulatedBackend:
    """The same plumbing without CUDA graphs (CPU tests, debugging)."""

    name = "emulate"

    def capture(self, run: Callable[[], Any]) -> tuple[Any, Any]:
        result = run()
        return _EmulatedGraph(run, ()), result

    def replay(self, graph: _EmulatedGraph) -> None:
        graph.replay()

    @contextlib.contextmanager
    def warmup_stream(self):
        yield


def make_backend(name: str, generators: Sequence[torch.Generator] = ()) -> _CudaBackend | _EmulatedBackend:
    """The graph backend called ``name`` (``cuda`` or ``emulate``)."""
    if name not in BACKENDS:
        raise ValueError(f"Unknown CUDA-graph backend {name!r}; choose one of {list(BACKENDS)}.")
    if name == "emulate":
        return _EmulatedBackend()
    if not torch.cuda.is_available():
        raise RuntimeError(
            "CUDA graphs need a CUDA GPU, and torch.cuda.is_available() is False. Run eagerly on this "
            "machine (drop the CUDA-graph scopes), or use backend='emulate' to exercise the plumbing."
        )
    if generators and not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
        raise RuntimeError(
            f"This torch ({torch.__version__}) cannot register extra generators with a CUDA graph "
            "(CUDAGraph.register_generator_state); use the default CUDA generator inside the scopes."
        )
    return _CudaBackend(generators)


class _Replay(torch.autograd.Function):
    """Autograd node of one replay: inputs copied in, forward graph replayed, static outputs out."""

    @staticmethod
    def forward(ctx, stage: GraphedStage, *tensors: Tensor):
        num_user = stage._num_user_tensors
        stage._copy_inputs(tensors[:num_user])
        stage._backend.replay(stage._fwd_graph)
        outputs = tuple(o.detach() for o in stage._static_outputs if o is not None)
        ctx.mark_non_differentiable(*(o for o, diff in zip(outputs, stage._output_diff) if not diff))
        ctx.stage = stage
        ctx.leaf_inputs = tuple(t.is_leaf and t.requires_grad for t in tensors[:num_user])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: Tensor):
        stage: GraphedStage = ctx.stage
        diff_grads = [g for g, diff in zip(grads, stage._output_diff) if diff]
        for static, grad in zip(stage._static_grad_outputs, diff_grads):
            if grad is None:
                static.zero_()
            elif static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        stage._backend.replay(stage._bwd_graph)
        results: list[Tensor | None] = [None]  # the `stage` argument
        grads_in = iter(stage._static_grads)
        for index, needs in enumerate(stage._input_diff):
            grad = next(grads_in) if needs else None
            if grad is not None and ctx.leaf_inputs[index]:
                grad = grad.clone()  # a leaf's .grad must not alias graph memory
            results.append(None if grad is None else grad.detach())
        for needs in stage._param_diff:
            grad = next(grads_in) if needs else None
            # Fresh tensors: AccumulateGrad would otherwise steal the static buffer (module docstring).
            results.append(None if grad is None else grad.clone())
        return tuple(results)


class GraphedStage:
    """A function of tensors (one scope of one layer) that runs eagerly, records, or replays a graph.

    ``fn(*inputs)`` returns a tuple of tensors or None; ``modules`` are the modules whose
    parameters (graph inputs) and buffers (side effects restored after capture) it uses.
    """

    def __init__(self, name: str, fn: Callable[..., tuple], modules: Sequence[nn.Module]) -> None:
        self.name = name
        self.fn = fn
        self.modules = tuple(modules)
        params: dict[int, nn.Parameter] = {}
        for module in self.modules:
            for param in module.parameters():
                params.setdefault(id(param), param)
        self.params = tuple(params.values())
        self.replays = 0
        self.eager_calls = 0
        self.eager_fallbacks = 0
        self._recorder: Callable[[GraphedStage, tuple], None] | None = None
        self._backend: Any = None
        self._signature: StageSignature | None = None
        self._static_inputs: tuple[Tensor | None, ...] = ()
        self._fwd_graph = self._bwd_graph = None
        self._warned = False

    # -- calls ---------------------------------------------------------------------------------

    @property
    def captured(self) -> bool:
        """Whether a graph is held and replayed for matching calls."""
        return self._fwd_graph is not None

    def __call__(self, *inputs: Tensor | None) -> tuple:
        if self.captured:
            reason = self._replay_refusal(inputs)
            if reason is None:
                self.replays += 1
                return self._replay(inputs)
            if reason != "not training":  # evaluation and no-grad calls are eager by design
                self.eager_fallbacks += 1
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"CUDA graph {self.name}: running eagerly ({reason}).", stacklevel=3)
        elif self._recorder is not None and torch.is_grad_enabled() and self._training():
            self._recorder(self, inputs)
        self.eager_calls += 1
        return self.fn(*inputs)

    def _training(self) -> bool:
        return all(module.training for module in self.modules)

    def _replay_refusal(self, inputs: Sequence[Tensor | None]) -> str | None:
        if not torch.is_grad_enabled() or not self._training():
            return "not training"
        signature = signature_of(inputs)
        if signature != self._signature:
            return f"inputs {signature[:-1]} / autocast {signature[-1]} differ from the captured {self._signature}"
        if any(p.data_ptr() != ptr for p, ptr in zip(self.params, self._param_ptrs)):
            raise RuntimeError(
                f"CUDA graph {self.name}: a parameter was reallocated after capture (param.data replaced or "
                "the module moved); the graph still reads the old memory. Release the graphs and capture again."
            )
        return None

    def _copy_inputs(self, tensors: Sequence[Tensor]) -> None:
        statics = (t for t in self._static_inputs if t is not None)
        for static, value in zip(statics, tensors):
            if static.data_ptr() != value.data_ptr():
                static.copy_(value.detach())

    def _replay(self, inputs: Sequence[Tensor | None]) -> tuple:
        user = tuple(t for t in inputs if t is not None)
        flat = iter(_Replay.apply(self, *user, *self.params))
        return tuple(None if o is None else next(flat) for o in self._static_outputs)

    # -- capture -------------------------------------------------------------------------------

    def prepare(self, inputs: Sequence[Tensor | None]) -> None:
        """Record the signature of a real call and keep copies of its inputs as the static buffers."""
        self._signature = signature_of(inputs)
        self._static_inputs = tuple(
            None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in inputs
        )
        self._num_user_tensors = sum(t is not None for t in inputs)

    def _autocast(self):
        enabled, dtype = self._signature[-1]
        device = next((t.device.type for t in self._static_inputs if t is not None), "cpu")
        if not enabled:
            return torch.autocast(device_type=device, enabled=False)
        return torch.autocast(device_type=device, dtype=dtype, cache_enabled=False)

    def _run(self) -> tuple:
        with torch.enable_grad(), self._autocast():
            return tuple(self.fn(*self._static_inputs))

    def _diff_inputs(self) -> list[Tensor]:
        user = [t for t in self._static_inputs if t is not None and t.requires_grad]
        return user + [p for p in self.params if p.requires_grad]

    def warmup(self, iterations: int) -> None:
        """Run forward and backward ``iterations`` times (lazy initialisation before capture)."""
        for _ in range(iterations):
            outputs = self._run()
            diff = [o for o in outputs if o is not None and o.requires_grad]
            if diff:
                torch.autograd.grad(
                    diff, self._diff_inputs(), grad_outputs=[torch.zeros_like(o) for o in diff], allow_unused=True
                )

    def capture_forward(self, backend: Any) -> None:
        """Capture the forward graph (call in forward execution order, after ``prepare``)."""
        self._backend = backend
        self._param_ptrs = tuple(p.data_ptr() for p in self.params)
        self._fwd_graph, outputs = backend.capture(self._run)
        self._graph_outputs = outputs
        self._static_outputs = tuple(None if o is None else o.detach() for o in outputs)
        present = [o for o in outputs if o is not None]
        self._output_diff = tuple(o.requires_grad for o in present)
        if isinstance(self._fwd_graph, _EmulatedGraph):
            self._fwd_graph.static = self._static_outputs
            self._fwd_graph.live = outputs

    def capture_backward(self, backend: Any) -> None:
        """Capture the backward graph (call in reverse order, after every ``capture_forward``)."""
        diff_outputs = [o for o in self._graph_outputs if o is not None and o.requires_grad]
        self._static_grad_outputs = [torch.zeros_like(o) for o in diff_outputs]
        diff_inputs = self._diff_inputs()
        self._input_diff = tuple(t.requires_grad for t in self._static_inputs if t is not None)
        self._param_diff = tuple(p.requires_grad for p in self.params)
        fwd = self._fwd_graph

        def run():
            outputs = fwd.live if isinstance(fwd, _EmulatedGraph) else self._graph_outputs
            live = [o for o in outputs if o is not None and o.requires_grad]
            if not live:
                return [None] * len(diff_inputs)
            return torch.autograd.grad(
                live, diff_inputs, grad_outputs=self._static_grad_outputs, allow_unused=True
            )

        self._bwd_graph, grads = backend.capture(run)
        self._static_grads = tuple(grads)
        if isinstance(self._bwd_graph, _EmulatedGraph):
            self._bwd_graph.static = self._static_grads
        self._graph_outputs = None  # the backward graph owns what it needs now

    def release(self) -> None:
        """Drop the graphs and static buffers; calls run eagerly afterwards."""
        self._fwd_graph = self._bwd_graph = self._backend = None
        self._static_inputs = self._static_outputs = self._static_grads = ()
        self._static_grad_outputs = []
        self._graph_outputs = None
        self._signature = None

    def stats(self) -> dict[str, int]:
        """Replays, eager calls, and eager fallbacks (training calls whose inputs differ from the capture)."""
        return {"replays": self.replays, "eager_calls": self.eager_calls, "eager_fallbacks": self.eager_fallbacks}
