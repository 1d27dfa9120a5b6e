"""A user's own Lightning project with MoE blocks: no lightning_moe model code, only two `MoELayer`s.

What a user writes who takes lightning_moe for its MoE layer and strategy only: a small GPT-style
language model with its own embedding, LayerNorm (its own class, not ``torch.nn.LayerNorm``),
causal self-attention and output head, whose feed-forward layers are two
:class:`lightning_moe.MoELayer` blocks; a ``LightningDataModule`` of random tokens. Everything is
built in ``__init__`` on the CPU (no ``configure_model``), trained by ``training_step`` with its
own AdamW; nothing here knows about parallelism.

It has no tensor-parallel plan: under ``MoEStrategy(tensor_parallel_size=2)`` its dense layers stay
replicated and each TP rank routes its slice of the MoE layers' input; expert parallelism shards
its experts. Used by the CLI tests (named by ``class_path`` in a YAML, the file
copied into a temporary "user project" first) and reusable wherever a realistic non-reference model
is needed::

    from helpers.user_model import RandomTokenDataModule, UserMoELM

The module imports nothing from the test tree, so a copy of the file works on its own
(:func:`write_user_project` makes that copy).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe import MoEConfig, MoELayer

__all__ = ["Block", "CausalSelfAttention", "LayerNorm", "RandomTokenDataModule", "UserMoELM", "write_user_project"]


class LayerNorm(nn.Module):
    """Layer normalisation over the last dimension, with a learned scale and shift."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension."""
        mean = x.mean(dim=-1, keepdim=True)
        var = (x - mean).pow(2).mean(dim=-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused q/k/v projection."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}.")
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        """``[B, S, H]`` to ``[B, S, H]``; position ``s`` attends to positions ``<= s``."""
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).split(hidden, dim=-1)
        q, k, v = (t.view(batch, seq, self.num_heads, hidden // self.num_heads).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, hidden))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + moe(ln2(x))``."""

    def __init__(self, hidden_size: int, num_heads: int, moe: MoEConfig) -> None:
        super().__init__()
        self.ln1 = LayerNorm(hidden_size)
        self.attn = CausalSelfAttention(hidden_size, num_heads)
        self.ln2 = LayerNorm(hidden_size)
        self.moe = MoELayer(moe)

    def forward(self, x: Tensor) -> Tensor:
        """One block over ``[B, S, H]``."""
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class UserMoELM(L.LightningModule):
    """A next-token language model with learned positions and two MoE blocks.

    Args:
        vocab_size: token ids.
        hidden_size: model width.
        num_heads: attention heads.
        num_experts: routed experts of each MoE block.
        top_k: experts per token.
        expert_ffn_hidden_size: hidden width of each expert.
        max_seq_len: longest sequence (rows of the position embedding).
        learning_rate: AdamW learning rate.
    """

    def __init__(
        self,
        vocab_size: int = 64,
        hidden_size: int = 32,
        num_heads: int = 4,
        num_experts: int = 4,
        top_k: int = 2,
        expert_ffn_hidden_size: int = 32,
        max_seq_len: int = 64,
        learning_rate: float = 1e-2,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        moe = MoEConfig(
            hidden_size=hidden_size, ffn_hidden_size=expert_ffn_hidden_size, num_experts=num_experts, top_k=top_k,
            load_balancing=["aux_loss"], aux_loss_coeff=0.01,
        )
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.pos = nn.Embedding(max_seq_len, hidden_size)
        self.blocks = nn.ModuleList(Block(hidden_size, num_heads, moe) for _ in range(2))
        self.ln_f = LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)
        with torch.no_grad():
            for emb in (self.embed, self.pos):
                emb.weight.normal_(0.0, 1.0 / math.sqrt(hidden_size))

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``[B, S, V]`` of ``tokens`` ``[B, S]``."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def _loss(self, batch) -> Tensor:
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx: int) -> Tensor:
        """Mean next-token cross-entropy of the batch."""
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        """Validation next-token cross-entropy."""
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over every parameter."""
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)


class RandomTokenDataModule(L.LightningDataModule):
    """Uniformly random token sequences (seeded, identical on every rank); each sample is one
    ``[seq_len + 1]`` tensor, inputs and targets are its shifted views.

    Args:
        vocab_size: token ids drawn from ``[0, vocab_size)``.
        seq_len: input tokens per sample.
        batch_size: samples per micro-batch on each data-parallel replica.
        num_samples: training samples (validation gets a quarter as many, at least one batch).
        seed: seed of the token generator.
    """

    def __init__(self, vocab_size: int = 64, seq_len: int = 16, batch_size: int = 4, num_samples: int = 64,
                 seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set = self.val_set = None

    def setup(self, stage: str | None = None) -> None:
        """Draw the samples (from ``seed``, so every rank draws the same)."""
        if self.train_set is None:
            hp = self.hparams
            g = torch.Generator().manual_seed(hp.seed)
            num_val = max(hp.num_samples // 4, hp.batch_size)
            tokens = torch.randint(0, hp.vocab_size, (hp.num_samples + num_val, hp.seq_len + 1), generator=g)
            self.train_set = TensorDataset(tokens[: hp.num_samples])
            self.val_set = TensorDataset(tokens[hp.num_samples :])

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches."""
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        """Validation batches in order."""
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, drop_last=True)


def write_user_project(root: Path, config: str) -> Path:
    """A user's project in ``root``: this file as the package module ``my_project.user_model``
    (outside lightning_moe and the test tree) and ``config`` as ``root/user.yaml``; returns the YAML."""
    package = root / "my_project"
    package.mkdir()
    (package / "__init__.py").write_text("")
    shutil.copy(Path(__file__), package / "user_model.py")
    yaml_path = root / "user.yaml"
    yaml_path.write_text(config)
    return yaml_path
