"""Lightning precision plugins over :mod:`lightning_moe.precision` (FP8 with PyTorch or Transformer Engine)."""

from lightning_moe.plugins.fp8 import MoEFP8Precision

__all__ = ["MoEFP8Precision"]
