"""FP8 training with PyTorch's own scaled GEMMs (``torch._scaled_mm``): no dependency beyond torch.

Numerics (dynamic scaling, recomputed from the tensors at every GEMM; nothing is kept between
steps, so there is no amax history to synchronise across ranks):

* ``rowwise`` (default, torchao's "rowwise" recipe): every operand is scaled per row along the
  contraction dimension, so each of the three GEMMs of a linear layer quantises its operands
  along its own contraction axis: forward ``y = x W^T`` (x per token, W per output feature),
  dgrad ``dx = dy W`` (dy per token, W per input feature), wgrad ``dW = dy^T x`` (per feature over
  the tokens). All operands in **e4m3** (forward and gradients): the grouped FP8 GEMM only takes
  e4m3, and the row scales give gradients the range e5m2 would otherwise buy.
* ``tensorwise``: one scale per tensor; activations and weights in e4m3, gradients in **e5m2** by
  default (``grad_dtype='e4m3'`` to change), the classic "hybrid" format.
* Scales are ``fp8_max / amax`` rounded down to a power of two (exact dequantisation, as torchao
  does); operands are saturated to the FP8 range. GEMMs accumulate in fp32 and return bf16
  (``torch._scaled_mm`` requires bf16 output with row-wise scales); the forward GEMM uses fast
  accumulation, the backward GEMMs do not. ``wgrad_fp8=False`` computes weight gradients in
  high precision instead.

CUDA rules of ``torch._scaled_mm`` are checked on every device (:func:`check_scaled_mm_operands`):
the left operand row-major, the right column-major, the contraction and output-feature sizes
multiples of 16. The token dimension of the weight-gradient GEMM (its contraction) is zero-padded
to a multiple of 16 when needed, so any batch shape works; layers whose features are not
multiples of 16 are left in high precision by
:func:`~lightning_moe.precision.torch_fp8_convert.convert_to_float8`. On CPU ``_scaled_mm``
runs too (the tests use it); training needs a CUDA GPU: rowwise scaling sm90 (Hopper) or newer,
tensorwise sm89 (Ada) or newer (:func:`require_fp8_device`).

The routed experts use the grouped version in :mod:`~lightning_moe.precision.torch_fp8_experts`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_moe import compat
from lightning_moe.precision.common import TORCH_RECIPES

__all__ = [
    "E4M3",
    "E5M2",
    "Float8Linear",
    "TorchFP8Recipe",
    "check_scaled_mm_operands",
    "float8_linear",
    "gemm_out_dtype",
    "quantize",
    "require_fp8_device",
    "scaled_mm_nt",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_FP8_DTYPES = {"e4m3": E4M3, "e5m2": E5M2}
_AMAX_EPS = 1e-12
GEMM_ALIGN = 16
"""The multiple of 16 that ``torch._scaled_mm`` needs of contraction and output-feature sizes."""


@dataclass(frozen=True)
class TorchFP8Recipe:
    """Settings of the ``torch`` FP8 backend (see the module docstring)."""

    scaling: str = "rowwise"
    """``rowwise`` or ``tensorwise`` dynamic scaling."""
    grad_dtype: str | None = None
    """FP8 format of gradients: None for the scaling's default (e4m3 rowwise, e5m2 tensorwise)."""
    wgrad_fp8: bool = True
    """Weight-gradient GEMMs in FP8 (Megatron ``fp8_wgrad``); False keeps them in high precision."""
    power_of_2_scales: bool = True
    """Round scales down to powers of two (exact dequantisation)."""
    fast_accum: bool = True
    """Fast accumulation in the forward GEMM (Hopper); backward GEMMs never use it."""

    def __post_init__(self) -> None:
        if self.scaling not in TORCH_RECIPES:
            raise ValueError(f"Unknown torch FP8 scaling {self.scaling!r}; choose one of {list(TORCH_RECIPES)}.")
        if self.grad_dtype is not None and self.grad_dtype not in _FP8_DTYPES:
            raise ValueError(f"grad_dtype must be one of {sorted(_FP8_DTYPES)} or None, got {self.grad_dtype!r}.")
        if self.scaling == "rowwise" and self.grad_dtype == "e5m2":
            raise ValueError(
                "grad_dtype='e5m2' is not available with rowwise scaling: every rowwise operand is e4m3 (the "
                "grouped FP8 GEMM of the experts only takes e4m3). Use scaling='tensorwise' for e5m2 gradients."
            )

    @property
    def rowwise(self) -> bool:
        return self.scaling == "rowwise"

    @property
    def grad_fp8_dtype(self) -> torch.dtype:
        """The torch dtype gradients are quantised to."""
        if self.grad_dtype is not None:
            return _FP8_DTYPES[self.grad_dtype]
        return E4M3 if self.rowwise else E5M2


def quantize(
    x: Tensor, dtype: torch.dtype = E4M3, dim: int | None = None, power_of_2: bool = True
) -> tuple[Tensor, Tensor]:
    """Scale ``x`` into the FP8 range and cast; returns ``(q, inverse_scale)`` with ``x ~ q * inverse_scale``.

    ``dim=None`` scales the whole tensor (0-dim fp32 inverse scale); an int scales each slice
    along ``dim`` separately (``keepdim`` shape, fp32).
    """
    magnitude = x.detach().abs()
    amax = (magnitude.amax() if dim is None else magnitude.amax(dim=dim, keepdim=True)).float()
    fp8_max = torch.finfo(dtype).max
    scale = fp8_max / amax.clamp(min=_AMAX_EPS)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
    return q, scale.reciprocal()


def _is_row_major(t: Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) >= t.shape[1] or t.shape[0] <= 1)


def _is_col_major(t: Tensor) -> bool:
    return t.dim() == 2 and t.stride(0) == 1 and (t.stride(1) >= t.shape[0] or t.shape[1] <= 1)


def check_scaled_mm_operands(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> None:
    """Raise ``ValueError`` unless ``torch._scaled_mm(a, b, scale_a, scale_b)`` meets the CUDA rules."""
    if not (_is_row_major(a) and _is_col_major(b)):
        raise ValueError(f"_scaled_mm needs a row-major and b column-major, got strides {a.stride()} / {b.stride()}.")
    if a.shape[1] % GEMM_ALIGN or b.shape[0] % GEMM_ALIGN or b.shape[1] % GEMM_ALIGN:
        raise ValueError(f"_scaled_mm needs K and N multiples of 16, got a {tuple(a.shape)} @ b {tuple(b.shape)}.")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        raise ValueError("_scaled_mm scales must be fp32.")
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return
    if tuple(scale_a.shape) != (a.shape[0], 1) or tuple(scale_b.shape) != (1, b.shape[1]):
        raise ValueError(
            f"Row-wise scales must be ({a.shape[0]}, 1) and (1, {b.shape[1]}), got {tuple(scale_a.shape)} / "
            f"{tuple(scale_b.shape)}."
        )
    if out_dtype != torch.bfloat16 or a.dtype != E4M3 or b.dtype != E4M3:
        raise ValueError("Row-wise scaled GEMMs take e4m3 operands and give bf16 outputs.")


def gemm_out_dtype(x: Tensor) -> torch.dtype:
    """Dtype a GEMM on ``x`` should return: the autocast dtype when autocast is on, else ``x``'s."""
    device = x.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def scaled_mm_nt(
    a: Tensor,
    b: Tensor,
    a_dtype: torch.dtype = E4M3,
    b_dtype: torch.dtype = E4M3,
    rowwise: bool = True,
    out_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
    power_of_2: bool = True,
) -> Tensor:
    """``a @ b.T`` in FP8 for high-precision ``a`` ``[M, K]`` and ``b`` ``[N, K]``; returns ``[M, N]``.

    Both operands are quantised along K (per row with ``rowwise``, else per tensor). K and N are
    zero-padded to multiples of 16 when needed (exact: zeros add nothing).
    """
    num_out = b.shape[0]
    pad_k = -a.shape[1] % GEMM_ALIGN
    if pad_k:
        a, b = F.pad(a, (0, pad_k)), F.pad(b, (0, pad_k))
    pad_n = -num_out % GEMM_ALIGN
    if pad_n:
        b = F.pad(b, (0, 0, 0, pad_n))
    dim = -1 if rowwise else None
    qa, scale_a = quantize(a.contiguous(), a_dtype, dim, power_of_2)
    qb, scale_b = quantize(b.contiguous(), b_dtype, dim, power_of_2)
    mat_b = qb.t()
    if rowwise:
        scale_b = scale_b.reshape(1, -1)
    gemm_dtype = torch.bfloat16 if rowwise else out_dtype
    check_scaled_mm_operands(qa, mat_b, scale_a, scale_b, gemm_dtype)
    out = compat.scaled_mm(qa, mat_b, scale_a=scale_a, scale_b=scale_b, out_dtype=gemm_dtype, use_fast_accum=fast_accum)
    if pad_n:
        out = out[:, :num_out]
    return out.to(out_dtype)


class _Float8LinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with the three GEMMs in FP8 (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, recipe: TorchFP8Recipe) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        out_dtype = gemm_out_dtype(x)
        y = scaled_mm_nt(
            x2, weight, E4M3, E4M3, recipe.rowwise, out_dtype, recipe.fast_accum, recipe.power_of_2_scales
        )
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.has_bias, ctx.bias_dtype = recipe, bias is not None, None if bias is None else bias.dtype
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        recipe: TorchFP8Recipe = ctx.recipe
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        gdt, rowwise, p2 = recipe.grad_fp8_dtype, recipe.rowwise, recipe.power_of_2_scales
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_mm_nt(dy, weight.t(), gdt, E4M3, rowwise, x.dtype, False, p2).view(x.shape)
        if ctx.needs_input_grad[1]:
            if recipe.wgrad_fp8:
                grad_w = scaled_mm_nt(dy.t(), x2.t(), gdt, E4M3, rowwise, weight.dtype, False, p2)
            else:
                grad_w = (dy.t().to(x2.dtype) @ x2).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None


def float8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, recipe: TorchFP8Recipe) -> Tensor:
    """``F.linear(x, weight, bias)`` with FP8 GEMMs (``x`` ``[..., K]``, ``weight`` ``[N, K]``)."""
    return _Float8LinearFunction.apply(x, weight, bias, recipe)


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run in FP8; same parameters and state dict as ``nn.Linear``.

    Made by :func:`convert_to_float8` from an existing ``nn.Linear`` (its class is swapped, so
    parameters, hooks and tags stay in place); ``fp8_recipe`` holds the :class:`TorchFP8Recipe`.
    """

    fp8_recipe: TorchFP8Recipe = TorchFP8Recipe()

    def forward(self, x: Tensor) -> Tensor:
        return float8_linear(x, self.weight, self.bias, self.fp8_recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_recipe.scaling}"


def require_fp8_device(recipe: TorchFP8Recipe) -> None:
    """Raise ``RuntimeError`` unless a CUDA GPU that can run ``recipe``'s scaled GEMMs is present."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "The torch FP8 backend needs a CUDA GPU with FP8 tensor cores (torch._scaled_mm), and "
            "torch.cuda.is_available() is False. Train without the FP8 plugin on this machine."
        )
    needed = (9, 0) if recipe.rowwise else (8, 9)
    capability = torch.cuda.get_device_capability()
    if capability < needed:
        raise RuntimeError(
            f"{recipe.scaling} FP8 GEMMs need compute capability >= {needed}, this GPU has {capability}"
            + ("; use recipe='tensorwise' on Ada GPUs." if recipe.rowwise and capability >= (8, 9) else ".")
        )
