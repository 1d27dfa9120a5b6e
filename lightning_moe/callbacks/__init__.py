"""Thin Lightning callbacks over the core packages (``metrics/``, ``memory/``, ``graphs/``)."""

from lightning_moe.callbacks.cuda_graphs import CUDAGraphCapture
from lightning_moe.callbacks.expert_bias import ExpertBiasUpdater
from lightning_moe.callbacks.load_balance import LoadBalanceMonitor
from lightning_moe.callbacks.loss_scaling import MoELossScaling
from lightning_moe.callbacks.offload import ActivationOffload
from lightning_moe.callbacks.recompute import SelectiveRecompute
from lightning_moe.callbacks.sigterm_checkpoint import CheckpointOnSigterm

__all__ = [
    "ActivationOffload", "CUDAGraphCapture", "CheckpointOnSigterm", "ExpertBiasUpdater", "LoadBalanceMonitor", "MoELossScaling",
    "SelectiveRecompute",
]
