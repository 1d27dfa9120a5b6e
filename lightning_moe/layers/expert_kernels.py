"""The expert MLP math, expert by expert, with a hand-written backward.

Every expert ``e`` maps its rows ``x_e`` to ``y_e = (act(x_e W1_e^T (+ b1_e)) * p_e) W2_e^T (+ p_e b2_e)``:
the routing probability ``p`` multiplies the activation output, before fc2 (Megatron Core's
order, so the combine is a plain sum).

Why a custom autograd function rather than ``grouped_mm`` under autograd:

* On CPU ``grouped_mm`` is a loop of ``mm`` calls anyway; looping here lets the activation, its
  backward and the probability products run on one expert's chunk while it is in cache, instead
  of streaming ``[N, F]`` intermediates through memory (the reason Megatron's sequential experts
  beat whole-tensor grouped GEMMs on CPU at large sizes).
* The optional ``row_index`` fuses the permutation into the kernel: rows are gathered from the
  unpermuted tokens and the outputs scatter-added back, one expert at a time, so the ``[N, H]``
  permuted copies of the tokens and of the outputs are never built (forward or backward). When
  ``row_index`` is a pure permutation (each row exactly once), the scatters are ``index_copy``:
  deterministic on every device, where CUDA's ``index_add`` accumulates with atomics.
* Weight gradients are written straight into one ``[E, out, in]`` tensor, never per-expert
  indexing of a stacked parameter under autograd (which zero-fills a full-size gradient per
  expert).
* The GEMMs go through :mod:`lightning_moe.layers.cpu_gemm`: on CPUs where oneDNN's fp32
  kernels beat the BLAS behind ``torch.mm`` (about 2x on AVX-512 AMD processors), the kernel
  uses oneDNN and computes each expert on its rows plus zero rows up to a bucketed size (the
  padding rows' results are zero or dropped).

On CUDA the per-expert loop is kept for correctness; the grouped GEMM path in
:mod:`lightning_moe.layers.experts` is chosen there instead where it has a fast path.

Both kernels compute in :func:`expert_compute_dtype` (autocast's dtype under autocast, with the
CPU half-precision policy) and accumulate per-token sums in :func:`accumulation_dtype`.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_moe.compat import current_graph_task_id
from lightning_moe.layers.activations import activation_backward, activation_fn, activation_with_cache
from lightning_moe.layers.cpu_gemm import gemm_for
from lightning_moe.layers.permute import check_permutation_sizes

__all__ = ["ExpertGradWorkspace", "ExpertMLPFunction", "GroupedActivationFc2Function", "accumulation_dtype",
           "autocast_disabled", "cpu_has_bf16_units", "expert_compute_dtype", "expert_mlp", "grouped_activation_fc2",
           "reference_expert_mlp"]


@functools.cache
def cpu_has_bf16_units() -> bool:
    """True when this CPU has bf16 arithmetic (AVX-512 BF16 or AMX): bf16 GEMMs then beat fp32.

    Without it (AVX2) a bf16 GEMM runs ~28x slower than fp32 (measured, ``benchmarks/moe_layer.py``).
    """
    cpu = getattr(torch, "cpu", None)
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in probes)


def expert_compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the expert GEMMs of both kernels run in, for inputs of ``dtype`` on ``device``.

    The autocast dtype when autocast is on for ``device`` (``grouped_mm`` is in none of autocast's
    cast lists, so the kernels cast themselves), else the input's. On CPU half precision is
    computed in fp32 unless the CPU has bf16 units (then bf16 stays bf16): CPUs without them run
    bf16 GEMMs ~28x slower than fp32.
    """
    if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
        dtype = torch.get_autocast_dtype(device.type)
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.bfloat16 if dtype == torch.bfloat16 and cpu_has_bf16_units() else torch.float32
    return dtype


def autocast_disabled(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off for ``device``'s type, for code that casts its operands explicitly.

    Used by both expert kernels and by the router's gating. Devices without autocast (meta)
    cannot even disable it; there is nothing to turn off there.
    """
    if not torch.amp.is_autocast_available(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def accumulation_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype per-token sums over K experts (and input gradients) accumulate in.

    fp32 when computing in half precision, as upstream's unpermute does in the (fp32) probs dtype.
    """
    return torch.float32 if compute_dtype in (torch.bfloat16, torch.float16) else compute_dtype


class ExpertGradWorkspace:
    """Reuses the memory of the stacked expert weight gradients from one step to the next.

    A fresh ``[E, 2F, H]`` gradient every step costs page faults on CPU (allocations this large
    come straight from the operating system), about 3% of an MoE layer's backward at realistic
    sizes. The workspace keeps the storage and hands autograd a new tensor over it each step, so
    ``param.grad`` ends up in the same memory (as Megatron's persistent gradient buffers do), or,
    when ``param.grad`` already exists (e.g. a view into a gradient-sync bucket), autograd adds the
    workspace tensor into it in place and the memory is free again.

    The memory is never handed out while it may still hold a gradient; a fresh tensor is used then:

    * the parameter's current gradient lives in it (gradient accumulation over backward calls,
      ``zero_grad(set_to_none=False)``);
    * it was handed out earlier in this backward and autograd has not accumulated it into the
      parameter yet: the layer is used twice in one backward (DPO chosen/rejected passes, siamese
      losses, shared weights), whose two weight gradients autograd sums only once both exist. A
      post-accumulate-grad hook on the parameter marks the memory free again when that backward
      (the same graph task: a nested backward, as in reentrant checkpointing, does not count)
      has accumulated the gradient. A backward that never accumulates (``torch.autograd.grad``)
      leaves the memory marked, so the next backward uses a fresh tensor: safe, just slower once.

    The one visible effect: a gradient tensor someone kept from an earlier step (after
    ``zero_grad(set_to_none=True)``) is overwritten by the next backward.
    """

    def __init__(self) -> None:
        self._storage: dict[str, Tensor] = {}
        self._lent: dict[str, int] = {}
        """Names whose memory is handed out, with the graph task (backward call) it was handed to."""
        self._hooked: dict[str, tuple[weakref.ref, object]] = {}

    def __getstate__(self) -> dict:
        # A cache: copies (deepcopy, pickling) start empty; hook handles and weakrefs do not copy.
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def place(self, name: str, memory: Tensor | None) -> None:
        """From the next backward on, hand out ``memory`` for ``name``'s gradient instead of memory of
        its own (which is then freed); None lets go of memory placed before (the workspace then
        allocates its own again).

        For a gradient-sync bucket's slot of this weight (its local shape, dtype and device): the
        kernel then writes the weight gradient straight into the bucket, so it is neither copied
        there nor kept twice, as Megatron's weight-gradient kernels write into its grad buffer. The
        rules above still decide when the memory may be handed out.
        """
        if memory is None:
            self._storage.pop(name, None)
        else:
            self._storage[name] = memory

    def gradient_for(self, name: str, param: Tensor, dtype: torch.dtype) -> Tensor:
        """An uninitialised tensor shaped like the leaf ``param`` for its gradient."""
        kept = self._storage.get(name)
        if kept is None or kept.shape != param.shape or kept.dtype != dtype or kept.device != param.device:
            kept = self._storage[name] = torch.empty(param.shape, dtype=dtype, device=param.device)
        self._watch(name, param)
        current = param.grad
        in_grad = current is not None and current.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr()
        if name in self._lent or in_grad:
            return torch.empty_like(kept)
        self._lent[name] = _graph_task_id()
        # A new tensor object over the kept storage: autograd adopts it as param.grad without a copy.
        return kept.view(kept.shape)

    def _watch(self, name: str, param: Tensor) -> None:
        """Hook ``param`` (once per parameter object) so that its accumulation frees the memory."""
        hooked = self._hooked.get(name)
        if hooked is not None and hooked[0]() is param:
            return
        if hooked is not None:
            hooked[1].remove()
        handle = param.register_post_accumulate_grad_hook(_release_hook(weakref.ref(self), name))
        self._hooked[name] = (weakref.ref(param), handle)


def _graph_task_id() -> int:
    """Id of the backward call running now (-1 outside one, or where torch cannot tell)."""
    return current_graph_task_id()


def _release_hook(workspace: weakref.ref, name: str) -> Callable[[Tensor], None]:
    # Weak: a workspace that was dropped (grad_workspace = None) must not be kept alive by the hook.
    def release(param: Tensor) -> None:
        owner = workspace()
        if owner is not None and owner._lent.get(name) == _graph_task_id():
            del owner._lent[name]

    return release


def _padded_index(row_index: Tensor | None, counts: list[int], padded: list[int]) -> Tensor | None:
    """``row_index`` with room at its end for the last expert's padding rows (token 0, zeroed later)."""
    extra = max((m - n for m, n in zip(padded, counts)), default=0)
    if row_index is None or not extra:
        return row_index
    return torch.cat([row_index, row_index.new_zeros(extra)])


def _expert_rows(src: Tensor, index: Tensor | None, start: int, rows: int, padded: int) -> Tensor:
    """One expert's ``rows`` rows of the expert-major sequence, then ``padded - rows`` zero rows.

    Gathered through ``index`` (a padded row index) or sliced from ``src``. Zero padding keeps
    every padding row of the GEMMs' results zero (or dropped), so nothing from another expert's
    rows, not even a non-finite value, reaches this expert's outputs or weight gradients.
    """
    if index is not None:
        out = src.index_select(0, index[start:start + padded])
    elif padded == rows:
        return src[start:start + rows]
    else:
        out = src.new_empty((padded, *src.shape[1:]))
        out[:rows] = src[start:start + rows]
    if padded != rows:
        out[rows:] = 0
    return out


class ExpertMLPFunction(torch.autograd.Function):
    """Autograd function behind :func:`expert_mlp`; see the module docstring."""

    @staticmethod
    def forward(
        ctx, x, fc1, fc2, fc2_bias, probs, counts, row_index, num_out_rows, activation, save_act, workspace, cdt,
        gemm, permutation, fc1_bias, act_params,
    ):
        act = activation_fn(activation, **act_params)
        n_rows = sum(counts)
        out_rows = n_rows if row_index is None else num_out_rows
        # A permutation writes every output row exactly once: no zero fill, no accumulation.
        alloc = torch.empty if permutation else torch.zeros
        out = alloc(out_rows, fc2.shape[1], dtype=accumulation_dtype(cdt), device=x.device)
        padded = [gemm.padded_rows(n) for n in counts]
        index = _padded_index(row_index, counts, padded)
        # One buffer per expert rather than one [N, 2F] block: blocks this size come straight from
        # the OS on every step (page faults), per-expert chunks are recycled by the allocator.
        fc1_outs, act_outs = [], []
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            h = gemm.nt(_expert_rows(x, index, start, n, padded[e]).to(cdt), fc1[e].to(cdt))
            if fc1_bias is not None:
                # Padding rows become the bias too; their probability is zero, so they add nothing.
                h += fc1_bias[e].to(cdt)
            z = act(h)
            fc1_outs.append(h)
            if save_act:
                act_outs.append(z)
            p = _expert_rows(probs, None, start, n, padded[e]).unsqueeze(-1)
            y = gemm.nt((z * p).to(cdt), fc2[e].to(cdt))[:n]
            if fc2_bias is not None:
                y += p[:n].to(cdt) * fc2_bias[e].to(cdt)
            _write_rows(out, rows, y, row_index, permutation)
            start += n
        # The unpadded row index: the one the experts' saved-tensor tagging knows (never offloaded).
        ctx.save_for_backward(x, fc1, fc2, fc2_bias, fc1_bias, probs, row_index, *fc1_outs, *act_outs)
        ctx.counts, ctx.padded, ctx.activation, ctx.compute_dtype = counts, padded, activation, cdt
        ctx.act_params = act_params
        ctx.gemm, ctx.permutation = gemm, permutation
        ctx.workspace = workspace
        # The weights themselves, weakly: saved-tensor hooks hand backward other tensor objects,
        # whose .grad says nothing about the gradient being accumulated.
        ctx.weights = (weakref.ref(fc1), weakref.ref(fc2))
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, fc1, fc2, fc2_bias, fc1_bias, probs, row_index, *chunks = ctx.saved_tensors
        index = _padded_index(row_index, ctx.counts, ctx.padded)
        active = sum(1 for n in ctx.counts if n)
        fc1_outs, act_outs = chunks[:active], chunks[active:] or None
        cdt, gemm = ctx.compute_dtype, ctx.gemm
        grad_out = grad_out.to(cdt)
        need_x, need_w1, need_w2, need_b, need_p = ctx.needs_input_grad[:5]
        need_b1 = ctx.needs_input_grad[14]
        # Every row of x receives exactly one row's gradient through a permutation: no zero fill.
        alloc = torch.empty if ctx.permutation else torch.zeros
        grad_x = alloc(x.shape, dtype=accumulation_dtype(cdt), device=x.device) if need_x else None
        # Weight gradients are written expert by expert; only experts without rows need zeros.
        live_fc1, live_fc2 = (ref() for ref in ctx.weights)
        grad_fc1 = _weight_grad(ctx.workspace, "fc1", fc1 if live_fc1 is None else live_fc1, cdt) if need_w1 else None
        grad_fc2 = _weight_grad(ctx.workspace, "fc2", fc2 if live_fc2 is None else live_fc2, cdt) if need_w2 else None
        grad_b = torch.zeros(fc2_bias.shape, dtype=cdt, device=x.device) if need_b else None
        grad_b1 = torch.zeros(fc1_bias.shape, dtype=cdt, device=x.device) if need_b1 else None
        grad_p = torch.zeros(probs.shape, dtype=probs.dtype, device=x.device) if need_p else None
        start = chunk = 0
        for e, n in enumerate(ctx.counts):
            if n == 0:
                for grad in (grad_fc1, grad_fc2, grad_b):
                    if grad is not None:
                        grad[e].zero_()
                continue
            rows, m = slice(start, start + n), ctx.padded[e]
            h = fc1_outs[chunk]
            saved_z = None if act_outs is None else act_outs[chunk]
            chunk += 1
            dy = _expert_rows(grad_out, index, start, n, m)
            z, cache = activation_with_cache(ctx.activation, h, **ctx.act_params) if saved_z is None else (saved_z, None)
            p = _expert_rows(probs, None, start, n, m).unsqueeze(-1)
            if need_w2:
                gemm.tn_into(dy, (z * p).to(cdt), grad_fc2[e])
            if need_b:
                grad_b[e] = (dy[:n] * p[:n].to(cdt)).sum(0)
            da = gemm.nn(dy, fc2[e].to(cdt))
            if need_p:
                dp = (da[:n] * z[:n]).sum(-1, dtype=torch.float32)
                if fc2_bias is not None:
                    dp += dy[:n] @ fc2_bias[e].to(cdt)
                grad_p[rows] = dp.to(probs.dtype)
            start += n
            if not (need_x or need_w1 or need_b1):
                continue
            dh = activation_backward(ctx.activation, h, da.mul_(p), cache, **ctx.act_params)
            if need_b1:
                grad_b1[e] = dh[:n].sum(0)
            if need_w1:
                gemm.tn_into(dh, _expert_rows(x, index, rows.start, n, m).to(cdt), grad_fc1[e])
            if need_x:
                _write_rows(grad_x, rows, gemm.nn(dh, fc1[e].to(cdt))[:n], row_index, ctx.permutation)

        def cast(grad, like):
            return None if grad is None else grad.to(like.dtype)

        return (
            cast(grad_x, x), cast(grad_fc1, fc1), cast(grad_fc2, fc2),
            cast(grad_b, fc2_bias) if fc2_bias is not None else None, grad_p,
            None, None, None, None, None, None, None, None, None,
            cast(grad_b1, fc1_bias) if fc1_bias is not None else None, None,
        )


def _write_rows(dest: Tensor, rows: slice, values: Tensor, row_index: Tensor | None, permutation: bool) -> None:
    """Write expert-major rows ``rows`` (``values``) into ``dest``, at ``rows`` or at their tokens.

    Through ``row_index`` the rows are copied to their tokens when it is a permutation (each token
    written once), else summed per token over its K experts.
    """
    if row_index is None:
        dest[rows] = values
    elif permutation:
        dest.index_copy_(0, row_index[rows], values.to(dest.dtype))
    else:
        dest.index_add_(0, row_index[rows], values.to(dest.dtype))


def _weight_grad(workspace: ExpertGradWorkspace | None, name: str, param: Tensor, dtype: torch.dtype) -> Tensor:
    # The workspace only for the parameters themselves (leaves: a cast copy's gradient never becomes
    # param.grad) and for gradients in the parameter's dtype (which autograd adopts without a cast).
    if workspace is None or dtype != param.dtype or not (param.is_leaf and param.requires_grad):
        return torch.empty(param.shape, dtype=dtype, device=param.device)
    return workspace.gradient_for(name, param, dtype)


def expert_mlp(
    x: Tensor,
    fc1: Tensor,
    fc2: Tensor,
    probs: Tensor,
    counts: list[int],
    activation: str = "swiglu",
    fc2_bias: Tensor | None = None,
    row_index: Tensor | None = None,
    num_out_rows: int | None = None,
    save_activation: bool = True,
    grad_workspace: ExpertGradWorkspace | None = None,
    compute_dtype: torch.dtype | None = None,
    row_index_is_permutation: bool = False,
    fc1_bias: Tensor | None = None,
    activation_params: dict[str, float] | None = None,
) -> Tensor:
    """Run every expert on its rows; probs multiply the activation output before fc2.

    Args:
        x: ``[N, H]`` rows already in expert-major order, or (with ``row_index``) the ``[T, H]``
            unpermuted tokens to gather from.
        fc1: ``[E, F1, H]`` (``F1 = 2F`` for gated activations, gate rows first).
        fc2: ``[E, H, F]``.
        probs: ``[N]`` routing probability of each row (expert-major order).
        counts: rows per expert, a host list summing to ``N``.
        fc2_bias: optional ``[E, H]``, scaled by the probability like the rest of the output.
        row_index: ``[N]`` token index of each expert-major row; the output is then the
            ``[num_out_rows, H]`` scatter-add of the rows (a fused permute/unpermute).
        save_activation: keep the activation output for backward (faster); False recomputes
            it from the saved fc1 output (saves ``N x F`` elements, Megatron's ``moe_act``
            recompute).
        grad_workspace: reuse weight-gradient memory across steps (see :class:`ExpertGradWorkspace`).
        compute_dtype: dtype of the GEMMs; None chooses per device and autocast (:func:`expert_compute_dtype`).
            ``fc1``/``fc2`` may already be in it (a cast copy); otherwise each expert's block is cast.
        row_index_is_permutation: ``row_index`` holds every one of the ``num_out_rows`` rows of ``x``
            exactly once (the all-to-all dispatcher's received rows): outputs and input gradients
            are then scattered with ``index_copy`` (deterministic) instead of ``index_add``.
        fc1_bias: optional ``[E, F1]``, added to the fc1 output before the activation (rows like fc1's).
        activation_params: keyword parameters of ``activation`` (``clamped_swiglu``'s ``alpha`` and ``limit``).

    Returns:
        ``[N, H]`` expert outputs in row order, or ``[num_out_rows, H]`` combined per token.
    """
    if len(counts) != fc1.shape[0]:
        raise ValueError(f"counts has {len(counts)} entries for {fc1.shape[0]} experts.")
    if row_index is not None and num_out_rows is None:
        raise ValueError("row_index needs num_out_rows, the number of tokens to combine into.")
    permutation = bool(row_index_is_permutation) and row_index is not None
    if permutation:
        check_permutation_sizes(row_index, num_out_rows, x.shape[0])
    # The function chooses its compute dtype itself (autocast included, see expert_compute_dtype) and
    # casts explicitly; autocast inside it would mix dtypes in its in-place accumulations.
    cdt = compute_dtype or expert_compute_dtype(x.dtype, x.device)
    gemm = gemm_for(x.device, cdt, fc1.shape[2], fc1.shape[1])
    with autocast_disabled(x.device):
        return ExpertMLPFunction.apply(
            x, fc1, fc2, fc2_bias, probs, list(counts), row_index, num_out_rows, activation, save_activation,
            grad_workspace, cdt, gemm, permutation, fc1_bias, dict(activation_params or {}),
        )


def reference_expert_mlp(
    x, fc1, fc2, probs, counts, activation="swiglu", fc2_bias=None, fc1_bias=None, activation_params=None
):
    """Plain autograd loop over experts: the oracle for :func:`expert_mlp` and the grouped path."""
    act = activation_fn(activation, **(activation_params or {}))
    outs, start = [], 0
    for e, n in enumerate(counts):
        rows = slice(start, start + n)
        p = probs[rows].unsqueeze(-1)
        h = x[rows] @ fc1[e].t()
        if fc1_bias is not None:
            h = h + fc1_bias[e]
        y = (act(h) * p).to(x.dtype) @ fc2[e].t()
        if fc2_bias is not None:
            y = y + p * fc2_bias[e]
        outs.append(y.to(x.dtype))
        start += n
    return torch.cat(outs) if outs else x.new_zeros(0, fc2.shape[1])


class GroupedActivationFc2Function(torch.autograd.Function):
    """``grouped_mm(act(h) * p, fc2^T)`` keeping only ``h``, ``p`` and ``fc2`` for backward.

    The ``grouped_mm`` kernel's form of Megatron's ``moe_act`` output-discarding recompute: the
    activation output (and its intermediates) are recomputed in backward from the saved fc1
    output ``h`` instead of being stored. Numerics follow the autograd path it replaces: the
    product with ``p`` in the wider of the two dtypes, cast to ``h``'s dtype before fc2.
    """

    @staticmethod
    def forward(ctx, h, probs, fc2, offsets, activation, act_params):
        z = (activation_fn(activation, **act_params)(h) * probs.unsqueeze(-1)).to(h.dtype)
        out = F.grouped_mm(z, fc2.transpose(-2, -1), offs=offsets)
        ctx.save_for_backward(h, probs, fc2, offsets)
        ctx.activation, ctx.act_params = activation, act_params
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h, probs, fc2, offsets = ctx.saved_tensors
        need_h, need_p, need_w = ctx.needs_input_grad[:3]
        p = probs.unsqueeze(-1)
        a, cache = activation_with_cache(ctx.activation, h, **ctx.act_params)
        grad_out = grad_out.contiguous()
        grad_fc2 = None
        if need_w:
            grad_fc2 = F.grouped_mm(grad_out.t(), (a * p).to(h.dtype), offs=offsets)
        dz = F.grouped_mm(grad_out, fc2, offs=offsets).to(torch.promote_types(a.dtype, probs.dtype))
        grad_p = (dz * a).sum(-1).to(probs.dtype) if need_p else None
        grad_h = activation_backward(ctx.activation, h, (dz * p).to(h.dtype), cache, **ctx.act_params) if need_h else None
        return grad_h, grad_p, grad_fc2, None, None, None


def grouped_activation_fc2(
    h: Tensor, probs: Tensor, fc2: Tensor, offsets: Tensor, activation: str, activation_params: dict | None = None
) -> Tensor:
    """fc2 of the ``grouped_mm`` experts with the activation recomputed in backward.

    Args:
        h: ``[N, F1]`` fc1 output in expert-major order.
        probs: ``[N]`` routing probability of each row.
        fc2: ``[E, H, F]``.
        offsets: int32 ``[E]`` cumulative rows per expert (``grouped_mm``'s ``offs``).
        activation: activation name.
        activation_params: its keyword parameters (``clamped_swiglu``'s ``alpha`` and ``limit``).

    Returns:
        ``[N, H]`` = ``grouped_mm((act(h) * p).to(h.dtype), fc2^T)``.
    """
    return GroupedActivationFc2Function.apply(h, probs, fc2, offsets, activation, dict(activation_params or {}))
