"""The LightningModule and LightningDataModule of the reference MoE language model."""

from lightning_moe.lit.data import TextDataModule
from lightning_moe.lit.module import MoELanguageModel

__all__ = ["MoELanguageModel", "TextDataModule"]
