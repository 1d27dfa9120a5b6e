"""A user's own model: own attention module, ``torch.nn.LayerNorm`` s and two ``lightning_moe.MoELayer`` s.

None of its modules has a reference-model name (``attn_norm``, ``ffn_norm``, ``q_proj``, ...) or
type (``TransformerBlock``, ``Attention``, ``CoreAttention``), so the memory features and the
CUDA-graph scopes only find what they find by the package's own layer types. Shared by
``tests/memory`` and ``tests/graphs``; import as ``from memory.user_model import ...``.

Why not ``helpers/user_model.py`` (the CLI tests' user project, whose attention module this one
uses): the byte counts of these tests need ``torch.nn.LayerNorm`` (it saves exactly its input,
mean and rstd; that project's own LayerNorm saves every intermediate), SGD, a seed per batch and
a LightningModule that records losses, gradients and saved bytes; that file must stay a
stand-alone user project.
"""

from __future__ import annotations

import warnings

import lightning as L
import torch
import torch.nn.functional as F
from helpers.user_model import CausalSelfAttention
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.callbacks.loss_scaling import MoELossScaling
from lightning_moe.memory import SavedTensorCounter

__all__ = ["HIDDEN", "SEQ", "VOCAB", "UserBlock", "UserLM", "UserModel", "fit_user", "user_batches"]

VOCAB, HIDDEN, HEADS, EXPERTS, FFN, SEQ = 64, 32, 4, 4, 16, 8


class UserBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``x + moe(norm2(x))`` (attention: fused ``qkv``, ``proj``)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size)
        self.attn = CausalSelfAttention(config.hidden_size, HEADS)
        self.norm2 = nn.LayerNorm(config.hidden_size)
        self.moe = MoELayer(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class UserModel(nn.Module):
    """Embedding, two :class:`UserBlock` s, a final ``LayerNorm`` and a linear head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        config = MoEConfig(
            hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=EXPERTS, top_k=2,
            shared_expert_ffn_hidden_size=FFN, load_balancing=["aux_loss"], aux_loss_coeff=1e-2,
            z_loss_coeff=1e-3, init_std=0.2,
        )
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(UserBlock(config) for _ in range(2))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        for module in self.modules():  # keep the activation output (the CPU default recomputes it)
            if hasattr(module, "recompute_activation"):
                module.recompute_activation = False

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """Next-token cross entropy."""
        return F.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())


def user_batches(count: int, batch: int = 2, seed: int = 1) -> Tensor:
    """``count * batch`` token rows ``[.., SEQ + 1]`` (a ``DataLoader`` of ``batch_size=batch`` splits them)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (count * batch, SEQ + 1), generator=generator)


class UserLM(L.LightningModule):
    """The user's LightningModule: SGD on :class:`UserModel`, recording what the tests compare.

    Per training step it keeps the loss, a copy of every parameter gradient (after backward) and,
    with ``count_saved=True``, the saved-activation bytes of the forward per region
    (:class:`~lightning_moe.memory.SavedTensorCounter` entered outermost, read after the forward
    and before backward; regions: ``"block{i}.attn"``, ``"block{i}.norm1"``, ``"block{i}.norm2"``,
    ``"other"``).
    """

    def __init__(self, net: UserModel, count_saved: bool = False) -> None:
        super().__init__()
        self.net = net
        self.count_saved = count_saved
        self.losses: list[Tensor] = []
        self.grads: list[dict[str, Tensor]] = []
        self.saved: list[dict[str, int]] = []

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        torch.manual_seed(100 + batch_idx)
        if not self.count_saved:
            loss = self.net.loss(batch[:, :-1], batch[:, 1:])
        else:
            counter = SavedTensorCounter(exclude=self)
            regions = {
                f"block{i}.{part}": getattr(block, part)
                for i, block in enumerate(self.net.blocks) for part in ("norm1", "attn", "norm2")
            }
            handles = counter.track(regions)
            with counter:
                loss = self.net.loss(batch[:, :-1], batch[:, 1:])
            self.saved.append(counter.saved_bytes())
            for handle in handles:
                handle.remove()
        self.losses.append(loss.detach().clone())
        return loss

    def on_after_backward(self) -> None:
        self.grads.append({n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit_user(callbacks: list, steps: int = 3, count_saved: bool = False, seed: int = 0, **trainer_kwargs):
    """``Trainer.fit`` of a fresh :class:`UserModel` (built from ``seed``) for ``steps`` steps on CPU.

    Returns the :class:`UserLM` and the text of every warning raised during the fit (each once
    per call site, as a user sees them: ``simplefilter("always")`` would repeat them).
    """
    data = user_batches(steps)
    lm = UserLM(UserModel(seed), count_saved=count_saved)
    kwargs = dict(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    kwargs.update(trainer_kwargs)
    # MoELossScaling: the routers' aux-loss gradients follow the loss, as in any user's run.
    trainer = L.Trainer(**kwargs, callbacks=[*callbacks, MoELossScaling()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers).*")
        trainer.fit(lm, DataLoader(data, batch_size=2))
    return lm, [str(w.message) for w in caught]
