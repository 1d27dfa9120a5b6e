"""`meta_weights`: ``Trainer.init_module(empty_init=True)`` under ``MoEStrategy``.

Modules built in it get their parameters and buffers on the meta device, to be sharded and then
materialised by the strategy (:func:`~lightning_moe.strategies.model_setup.materialize`), so no
rank ever holds the whole model. A torchmetrics ``Metric`` built in it is the exception: its
states are running sums whose initial values (zeros, ``-inf`` for a maximum, ...) nothing could
draw again, and ``Module.to_empty``-style materialisation would leave them uninitialised; they,
and everything else a metric builds, get storage on the given device as without ``empty_init``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torchmetrics import Metric

from lightning_moe.compat import device_constructors

__all__ = ["meta_weights"]


def _building_metric() -> bool:
    """Whether a torchmetrics ``Metric``'s ``__init__`` is on the call stack."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), Metric):
            return True
        frame = frame.f_back
    return False


class _MetricsOnDevice(TorchFunctionMode):
    """Gives tensor factories ``device`` while a metric is built under the meta default device."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func in device_constructors()
            and kwargs.get("device") is None
            and torch.get_default_device().type == "meta"  # not inside an explicit `with torch.device(...)`
            and _building_metric()
        ):
            kwargs["device"] = self.device
        return func(*args, **kwargs)


@contextmanager
def meta_weights(device: torch.device) -> Iterator[None]:
    """Build modules' tensors on the meta device, torchmetrics metrics' on ``device``."""
    with torch.device("meta"), _MetricsOnDevice(device):
        yield
