"""Assertions shared by the numerical tests."""

from __future__ import annotations

import math

import torch


def worst_error(previous: float, error: float) -> float:
    """The larger of two errors, NaN if either is: plain ``max(0.0, nan)`` is 0.0 and hides a NaN."""
    return math.nan if math.isnan(previous) or math.isnan(error) else max(previous, error)


def exceeds(error: float, tol: float) -> bool:
    """True when ``error`` is above ``tol`` or not a number (``nan > tol`` is False)."""
    return not error <= tol


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """``|actual - expected| <= tol * max|expected|`` elementwise (exact when expected is all zero).

    The tolerance scales with the largest expected value, so entries near zero are not held to a
    relative bound that rounding elsewhere in the computation could never meet.
    """
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.detach().to(expected.dtype),
        expected.detach(),
        rtol=0.0,
        atol=tol * scale,
        msg=lambda message: f"{what}: {message}",
    )


def assert_states_close(got: dict, want: dict, rtol: float, atol: float, what: str = "") -> None:
    """``got`` has exactly ``want``'s names, and each tensor is close to ``want``'s (named in the failure)."""
    prefix = f"{what} " if what else ""
    assert got.keys() == want.keys(), f"{prefix}names differ: {sorted(set(got) ^ set(want))}"
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{prefix}{n}: {m}")
