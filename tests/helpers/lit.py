"""A minimal LightningModule around a language model, for Trainer-level tests."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import lightning as L
import torch
from torch import nn


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


class LossRecordingLM(L.LightningModule):
    """Trains ``model.loss(tokens[:, :-1], tokens[:, 1:])`` on token batches and keeps every loss.

    ``optimizer`` builds the optimizer from the parameters (SGD with lr 0.05 by default).
    """

    def __init__(self, model: nn.Module, optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = _sgd):
        super().__init__()
        self.model = model
        self.make_optimizer = optimizer
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model.loss(batch[:, :-1], batch[:, 1:])
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())
