"""Expert activation functions, shared by routed and shared experts.

Gated activations (``swiglu``, ``clamped_swiglu``) take an fc1 output of width ``2F`` laid out as the ``F`` gate
columns followed by the ``F`` up columns, and return width ``F``. Plain activations map ``F``
to ``F``. The layout is part of the public state-dict format (docs/architecture.md §6).

``clamped_swiglu`` is GPT-OSS's: ``gate.clamp(max=limit) * sigmoid(alpha * gate.clamp(max=limit))
* (up.clamp(-limit, limit) + 1)``, with the parameters ``alpha`` and ``limit`` (keyword arguments
of every function here, GPT-OSS's 1.702 and 7.0 when left out; :data:`ACTIVATION_PARAMS` lists them,
the other activations take none).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "ACTIVATIONS", "ACTIVATION_PARAMS", "activation_backward", "activation_fn", "activation_with_cache", "is_gated",
]


def _swiglu(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _clamped_swiglu(x: Tensor, alpha: float, limit: float) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up.clamp(-limit, limit) + 1)


def _squared_relu(x: Tensor) -> Tensor:
    return torch.square(F.relu(x))


def _gelu(x: Tensor) -> Tensor:
    return F.gelu(x)


def _relu(x: Tensor) -> Tensor:
    return F.relu(x)


#: name -> (function, gated). Gated functions halve the last dimension.
ACTIVATIONS: dict[str, tuple[Callable[[Tensor], Tensor], bool]] = {
    "swiglu": (_swiglu, True),
    "clamped_swiglu": (_clamped_swiglu, True),
    "gelu": (_gelu, False),
    "relu": (_relu, False),
    "squared_relu": (_squared_relu, False),
}

#: name -> the keyword parameters its function takes, with their defaults; absent: none.
ACTIVATION_PARAMS: dict[str, dict[str, float]] = {"clamped_swiglu": {"alpha": 1.702, "limit": 7.0}}


def _lookup(name: str) -> tuple[Callable[[Tensor], Tensor], bool]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"Unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}."
        ) from None


def _resolve_params(name: str, params: dict[str, float]) -> dict[str, float]:
    """``params`` with the defaults of the ones left out; a parameter ``name`` does not take raises."""
    defaults = ACTIVATION_PARAMS.get(name, {})
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise ValueError(
            f"Activation {name!r} takes the parameters {sorted(defaults)}, got {unknown} as well."
        )
    return {**defaults, **params}


def activation_fn(name: str, **params: float) -> Callable[[Tensor], Tensor]:
    """The activation function called ``name`` (see :data:`ACTIVATIONS`), bound to ``params``
    (``alpha`` and ``limit`` for ``clamped_swiglu``, none for the others)."""
    fn = _lookup(name)[0]
    params = _resolve_params(name, params)
    return functools.partial(fn, **params) if params else fn


def is_gated(name: str) -> bool:
    """True when ``name`` is a gated activation whose fc1 output is ``[gate ; up]``."""
    return _lookup(name)[1]


def activation_with_cache(name: str, h: Tensor, **params: float) -> tuple[Tensor, tuple | None]:
    """``activation_fn(name, **params)(h)`` and the intermediates :func:`activation_backward` can reuse.

    Recomputing the activation in backward then costs almost nothing extra: SwiGLU's SiLU output
    (the clamped SwiGLU's sigmoid) is needed for its gradient anyway.
    """
    if name == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        silu = F.silu(gate)
        return silu * up, (silu,)
    if name == "clamped_swiglu":
        params = _resolve_params(name, params)
        gate, up = h.chunk(2, dim=-1)
        gate = gate.clamp(max=params["limit"])
        sig = torch.sigmoid(gate * params["alpha"])
        glu = gate * sig
        return glu * (up.clamp(-params["limit"], params["limit"]) + 1), (sig, glu)
    return activation_fn(name, **params)(h), None


def activation_backward(
    name: str, h: Tensor, grad_out: Tensor, cache: tuple | None = None, **params: float
) -> Tensor:
    """Gradient of ``activation_fn(name, **params)`` at ``h`` given the output gradient ``grad_out``.

    Written out by hand so expert kernels can recompute it chunk by chunk, in cache, without
    building an autograd graph per expert. ``cache`` is what :func:`activation_with_cache` returned.
    SwiGLU writes the two halves of its gradient in place rather than concatenating them.
    """
    _lookup(name)
    params = _resolve_params(name, params)
    if name == "clamped_swiglu":
        return _clamped_swiglu_backward(h, grad_out.to(h.dtype), cache, params["alpha"], params["limit"])
    if name == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        silu = cache[0] if cache is not None else F.silu(gate)
        grad_out = grad_out.to(h.dtype)
        if torch.is_grad_enabled() and (h.requires_grad or grad_out.requires_grad):
            # Differentiated itself (double backward): out= writes are not, so the composite form.
            sig = torch.sigmoid(gate)
            return torch.cat([grad_out * up * sig * (1 + gate * (1 - sig)), grad_out * silu], dim=-1)
        grad = torch.empty_like(h)
        grad_gate, grad_up = grad.chunk(2, dim=-1)
        torch.mul(grad_out, silu, out=grad_up)
        # d silu(g)/dg = sigmoid(g) * (1 + g * (1 - sigmoid(g))): aten's fused SiLU backward.
        torch.ops.aten.silu_backward.grad_input(grad_out * up, gate, grad_input=grad_gate)
        return grad
    if name == "relu":
        return grad_out * (h > 0)
    if name == "squared_relu":
        return grad_out * 2 * F.relu(h)
    # gelu (erf form): d/dh [h * Phi(h)] = Phi(h) + h * phi(h)
    cdf = 0.5 * (1 + torch.erf(h * 0.7071067811865476))
    pdf = torch.exp(-0.5 * h * h) * 0.3989422804014327
    return grad_out * (cdf + h * pdf)


def _clamped_swiglu_backward(h: Tensor, grad_out: Tensor, cache: tuple | None, alpha: float, limit: float) -> Tensor:
    # torch.clamp passes the gradient where min <= x <= max (bounds included): the same masks here.
    gate, up = h.chunk(2, dim=-1)
    clamped = gate.clamp(max=limit)
    if cache is None:
        sig = torch.sigmoid(clamped * alpha)
        glu = clamped * sig
    else:
        sig, glu = cache
    up_plus_one = up.clamp(-limit, limit) + 1
    # d/dg [g * sigmoid(alpha g)] = sigmoid(alpha g) * (1 + alpha g (1 - sigmoid(alpha g)))
    d_glu = sig * (1 + alpha * clamped * (1 - sig))
    grad_gate = grad_out * up_plus_one * d_glu * (gate <= limit)
    grad_up = grad_out * glu * ((up >= -limit) & (up <= limit))
    return torch.cat([grad_gate, grad_up], dim=-1)
