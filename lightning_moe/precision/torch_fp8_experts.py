"""FP8 routed experts on PyTorch's scaled GEMMs: ``torch._scaled_grouped_mm`` or one GEMM per expert.

Each of fc1 and fc2 is a grouped linear ``y[rows of e] = x[rows of e] W_e^T`` over the expert-major
rows (``counts`` rows per expert), computed by :class:`_Float8GroupedMM` with row-wise e4m3
scaling for every operand (the only scaling the grouped FP8 GEMM takes; torchao's MoE recipe):

* forward ``x [M, K] @ W^T``: x per row over K, W per (expert, output row) over K;
* dgrad ``dy [M, N] @ W``: dy per row over N, W per (expert, input column) over N;
* wgrad ``dW_e = dy_e^T x_e``: both per (expert, column) over that expert's rows, scales laid out
  group-major (``[e * N + n]``), the layout of ``torch._scaled_grouped_mm``'s 2-D x 2-D case.

Three implementations of the same quantised products (:data:`IMPLS`):

* ``grouped``: ``torch._scaled_grouped_mm``, one kernel per GEMM (CUDA, sm90+, every expert
  segment a multiple of 16 rows: what ``router_padding_alignment`` guarantees);
* ``loop``: one ``torch._scaled_mm`` per expert (any GPU with FP8, any segment sizes; segments
  are zero-padded to 16 rows where a GEMM contracts over them);
* ``emulate``: dequantise and multiply in fp32 (CPU tests, and the oracle the GPU tests compare
  the two real ones with).

``auto`` picks ``grouped`` when possible, else ``loop`` on CUDA and ``emulate`` elsewhere. Group
offsets are built on the device without a host copy when all segments have the same size (drop-
and-pad), so that case can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from lightning_moe import compat
from lightning_moe.layers.activations import activation_fn
from lightning_moe.layers.experts import GroupedExperts, group_offsets
from lightning_moe.precision.torch_fp8 import E4M3, TorchFP8Recipe, gemm_out_dtype, quantize

__all__ = ["IMPLS", "Float8GroupedExperts", "float8_grouped_linear", "group_offsets", "resolve_impl"]

IMPLS = ("auto", "grouped", "loop", "emulate")
_ALIGN = 16
_HAS_SCALED_GROUPED_MM = compat.has_scaled_grouped_mm()


def resolve_impl(impl: str, device: torch.device, counts: list[int], *sizes: int) -> str:
    """The implementation ``impl`` stands for on ``device`` with these segment ``counts`` and GEMM sizes."""
    if impl not in IMPLS:
        raise ValueError(f"Unknown FP8 grouped GEMM implementation {impl!r}; choose one of {list(IMPLS)}.")
    if impl != "auto":
        return impl
    if device.type != "cuda":
        return "emulate"
    aligned = all(c % _ALIGN == 0 for c in counts) and all(s % _ALIGN == 0 for s in sizes)
    if _HAS_SCALED_GROUPED_MM and aligned and torch.cuda.get_device_capability(device) >= (9, 0):
        return "grouped"
    return "loop"


def _quantize_per_group_columns(x: Tensor, offs: Tensor, num_groups: int, p2: bool) -> tuple[Tensor, Tensor]:
    """e4m3 ``x`` ``[M, C]`` with one scale per (group of rows, column); inverse scales ``[G * C]``."""
    rows, cols = x.shape
    group = torch.searchsorted(offs, torch.arange(rows, device=x.device, dtype=offs.dtype), right=True)
    magnitude = x.detach().abs().float()
    amax = torch.zeros(num_groups, cols, device=x.device, dtype=torch.float32)
    amax.scatter_reduce_(0, group.unsqueeze(1).expand(-1, cols), magnitude, "amax", include_self=True)
    fp8_max = torch.finfo(E4M3).max
    scale = fp8_max / amax.clamp(min=1e-12)
    if p2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (x.float() * scale.index_select(0, group)).clamp(-fp8_max, fp8_max).to(E4M3)
    return q, scale.reciprocal().reshape(-1)


class _Impl:
    """The two quantised products, for one implementation (values must agree across them)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def mm_2d3d(self, qa, qb, sa, sb, offs, counts, fast: bool) -> Tensor:
        """``out[rows of e] = (qa * sa)[rows of e] @ (qb[e] * sb[e])``; qa ``[M, K]``, qb ``[E, K, N]``."""
        if self.name == "grouped":
            return compat.scaled_grouped_mm(qa, qb, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast)
        out = qa.new_empty(qa.shape[0], qb.shape[2], dtype=torch.bfloat16)
        for e, rows in _expert_row_slices(counts):
            if self.name == "emulate":
                a = qa[rows].float() * sa[rows, None]
                out[rows] = (a @ (qb[e].float() * sb[e][None, :])).to(out.dtype)
            else:
                out[rows] = compat.scaled_mm(
                    qa[rows], qb[e], scale_a=sa[rows, None].contiguous(), scale_b=sb[e][None, :].contiguous(),
                    out_dtype=torch.bfloat16, use_fast_accum=fast,
                )
        return out

    def mm_2d2d(self, qa, qb, sa, sb, offs, counts) -> Tensor:
        """``out[e] = (qa[:, rows of e] * sa[e]) @ (qb[rows of e] * sb[e])``; qa ``[N, M]``, qb ``[M, K]``."""
        if self.name == "grouped":
            return compat.scaled_grouped_mm(qa, qb, sa, sb, offs=offs, out_dtype=torch.bfloat16)
        n, k = qa.shape[0], qb.shape[1]
        out = qa.new_zeros(len(counts), n, k, dtype=torch.bfloat16)
        for e, rows in _expert_row_slices(counts):
            count = rows.stop - rows.start
            scale_a, scale_b = sa[e * n : (e + 1) * n], sb[e * k : (e + 1) * k]
            if self.name == "emulate":
                a = qa[:, rows].float() * scale_a[:, None]
                out[e] = (a @ (qb[rows].float() * scale_b[None, :])).to(out.dtype)
                continue
            padded = count + (-count % _ALIGN)  # the contraction of _scaled_mm must be a multiple of 16
            a = torch.zeros(n, padded, dtype=qa.dtype, device=qa.device)
            a[:, :count] = qa[:, rows]
            b = torch.zeros(k, padded, dtype=qb.dtype, device=qb.device)
            b[:, :count] = qb[rows].t()
            out[e] = compat.scaled_mm(
                a, b.t(), scale_a=scale_a[:, None].contiguous(), scale_b=scale_b[None, :].contiguous(),
                out_dtype=torch.bfloat16,
            )
        return out


class _Float8GroupedMM(torch.autograd.Function):
    """Grouped ``x W_e^T`` with FP8 forward, dgrad and wgrad (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, counts: list[int], recipe: TorchFP8Recipe, impl: str) -> Tensor:
        offs = group_offsets(counts, x.device)
        ops = _Impl(impl)
        p2 = recipe.power_of_2_scales
        qx, sx = quantize(x.contiguous(), E4M3, -1, p2)
        qw, sw = quantize(weight.contiguous(), E4M3, -1, p2)  # [E, N, K], scales [E, N, 1]
        out = ops.mm_2d3d(qx, qw.transpose(-2, -1), sx.reshape(-1), sw.squeeze(-1), offs, counts, recipe.fast_accum)
        ctx.save_for_backward(x, weight, offs)
        ctx.counts, ctx.recipe, ctx.impl = counts, recipe, impl
        return out.to(gemm_out_dtype(x))

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight, offs = ctx.saved_tensors
        recipe: TorchFP8Recipe = ctx.recipe
        ops, counts, p2 = _Impl(ctx.impl), ctx.counts, recipe.power_of_2_scales
        grad_x = grad_w = None
        dy = grad_out.contiguous()
        if ctx.needs_input_grad[0]:
            qdy, sdy = quantize(dy, E4M3, -1, p2)
            wt = weight.transpose(-2, -1).contiguous()  # [E, K, N]: quantised over N per (e, k)
            qwt, swt = quantize(wt, E4M3, -1, p2)
            grad_x = ops.mm_2d3d(qdy, qwt.transpose(-2, -1), sdy.reshape(-1), swt.squeeze(-1), offs, counts, False)
            grad_x = grad_x.to(x.dtype)
        if ctx.needs_input_grad[1]:
            if recipe.wgrad_fp8:
                qdy_g, sdy_g = _quantize_per_group_columns(dy, offs, len(counts), p2)  # [M, N], [E * N]
                qx_g, sx_g = _quantize_per_group_columns(x, offs, len(counts), p2)  # [M, K], [E * K]
                qdy_t = qdy_g.t().contiguous()  # [N, M] row-major
                qx_col = qx_g.t().contiguous().t()  # [M, K] column-major
                grad_w = ops.mm_2d2d(qdy_t, qx_col, sdy_g, sx_g, offs, counts)
            else:
                grad_w = _high_precision_wgrad(dy, x, counts, weight.shape)
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None, None


def _high_precision_wgrad(dy: Tensor, x: Tensor, counts: list[int], shape: torch.Size) -> Tensor:
    grad = torch.zeros(shape, dtype=torch.float32, device=x.device)
    for e, rows in _expert_row_slices(counts):
        grad[e] = dy[rows].float().t() @ x[rows].float()
    return grad


def _expert_row_slices(counts: list[int]) -> Iterator[tuple[int, slice]]:
    """``(expert, its rows)`` for every expert with rows, in expert-major order."""
    start = 0
    for e, count in enumerate(counts):
        if count:
            yield e, slice(start, start + count)
        start += count


def float8_grouped_linear(x: Tensor, weight: Tensor, counts: list[int], recipe: TorchFP8Recipe, impl: str = "auto") -> Tensor:
    """``x[rows of e] @ weight[e]^T`` for expert-major rows ``x`` ``[M, K]``, ``weight`` ``[E, N, K]``."""
    if len(counts) != weight.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(
            f"counts {counts} must have one entry per expert ({weight.shape[0]}) and sum to the {x.shape[0]} rows."
        )
    resolved = resolve_impl(impl, x.device, counts, weight.shape[1], weight.shape[2])
    return _Float8GroupedMM.apply(x, weight, list(counts), recipe, resolved)


class Float8GroupedExperts(GroupedExperts):
    """``GroupedExperts`` whose fc1 and fc2 GEMMs run in FP8 (same parameters and state dict).

    Made by :func:`~lightning_moe.precision.torch_fp8_convert.convert_to_float8` (class swap);
    ``fp8_recipe`` holds the recipe, ``fp8_impl`` the grouped GEMM implementation (``auto``).
    Probabilities multiply the activation output before fc2, as in every expert kernel.
    """

    fp8_recipe: TorchFP8Recipe = TorchFP8Recipe()
    fp8_impl: str = "auto"

    def forward(
        self,
        tokens: Tensor,
        tokens_per_expert: list[int],
        probs: Tensor,
        row_index: Tensor | None = None,
        num_out_rows: int | None = None,
    ) -> Tensor:
        counts = list(tokens_per_expert)
        rows = tokens if row_index is None else tokens.index_select(0, row_index)
        p = probs.unsqueeze(-1)
        fc2_bias = self.fc2_bias_in_use()
        expert_of_row = None
        if self.fc1_bias is not None or self.fc2_bias is not None:
            expert_of_row = self.row_experts(group_offsets(counts, rows.device), rows.shape[0])
        h = float8_grouped_linear(rows, self.fc1_weight, counts, self.fp8_recipe, self.fp8_impl)
        if self.fc1_bias is not None:
            # The bias stays in high precision, added to the dequantised GEMM output.
            h = h + self.flat_fc1_bias()[expert_of_row].to(h.dtype)
        z = (activation_fn(self.activation, **self.activation_params)(h) * p).to(rows.dtype)
        out = float8_grouped_linear(z, self.fc2_weight, counts, self.fp8_recipe, self.fp8_impl)
        out = self.add_fc2_bias(out, p, expert_of_row, fc2_bias)
        if row_index is None:
            return out
        return out.new_zeros(num_out_rows, out.shape[1]).index_add(0, row_index, out)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_recipe.scaling}/{self.fp8_impl}"
