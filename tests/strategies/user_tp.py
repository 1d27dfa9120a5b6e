"""A user's LightningModule with its own tensor parallelism (Lightning's way) and a lightning_moe MoE layer.

Imported by ``test_user_tensor_parallel.py`` as ``from strategies.user_tp import ...``. The model
knows nothing of lightning_moe's parallelism: like a model written for Lightning's
``ModelParallelStrategy``, its ``configure_model`` applies torch's ``parallelize_module`` to its own
dense MLP with ``self.device_mesh["tensor_parallel"]``; its embedding, norm and head stay plain;
its feed-forward block after the MLP is one :class:`lightning_moe.MoELayer` (with a shared expert
and the aux loss, so routers, shared experts and aux-loss statistics are all exercised).

:func:`reference_run` is the single-process oracle, in plain PyTorch (no Lightning, no strategy,
no DTensor): the same network built from the same seed, trained with AdamW on the same global
batches as Lightning's ``DistributedSampler`` deals them to ``dp`` data-parallel replicas, each
replica's gradient computed on its own shard (the aux loss is per data-parallel rank, upstream's
definition), averaged over replicas and accumulated micro-batches, clipped by the whole model's norm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lightning as L
import torch
import torch.nn.functional as F
from strategies.toy import LOCAL_BATCH, sample_indices
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import TensorDataset

from lightning_moe import MoEConfig, MoELayer

__all__ = ["UserTPModule", "UserTPNet", "make_dataset", "reference_run"]

IN_FEATURES, HIDDEN, MLP, SEQ = 6, 16, 32, 4
MODEL_SEED, DATA_SEED = 4321, 7
AUX_COEFF = 1e-2


def make_dataset(num_samples: int) -> TensorDataset:
    """Deterministic ``(x [n, SEQ, IN], y [n, SEQ, 1], index [n])`` samples."""
    g = torch.Generator().manual_seed(DATA_SEED)
    return TensorDataset(torch.randn(num_samples, SEQ, IN_FEATURES, generator=g),
                         torch.randn(num_samples, SEQ, 1, generator=g), torch.arange(num_samples))


class UserTPNet(nn.Module):
    """Plain one-device network: input projection, a pre-norm MLP and a MoE block (both residual), a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(MODEL_SEED)
        self.inp = nn.Linear(IN_FEATURES, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, MLP)
        self.down = nn.Linear(MLP, HIDDEN)
        self.moe = MoELayer(MoEConfig(
            hidden_size=HIDDEN, ffn_hidden_size=8, num_experts=4, top_k=2, init_std=0.2,
            shared_expert_ffn_hidden_size=8, load_balancing=["aux_loss"], aux_loss_coeff=AUX_COEFF,
        ))
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        h = h + self.down(F.gelu(self.up(self.norm(h))))
        h = h + self.moe(h)
        return self.head(h)


class UserTPModule(L.LightningModule):
    """The user's LightningModule: tensor-parallel MLP applied in ``configure_model``; records its local losses."""

    def __init__(self, lr: float = 1e-2, mesh_dim: str = "tensor_parallel", tp_plan: bool = True) -> None:
        super().__init__()
        self.lr, self.mesh_dim, self.tp_plan = lr, mesh_dim, tp_plan
        self.net = UserTPNet()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if not self.tp_plan or isinstance(self.net.up.weight, DTensor):  # runs again for every fit/validate call
            return
        tp_mesh = self.device_mesh[self.mesh_dim]
        parallelize_module(self.net, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


@dataclass
class Reference:
    """The oracle's results: per micro-batch losses, per step gradients before clipping and norms, final state."""

    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, Tensor]] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    state: dict[str, Tensor] = field(default_factory=dict)


def reference_run(dataset: TensorDataset, dp: int, steps: int, accumulate: int, clip: float | None,
                  lr: float = 1e-2) -> Reference:
    """Train :class:`UserTPNet` in one process as ``dp`` replicas would (module docstring)."""
    net = UserTPNet()
    params = dict(net.named_parameters())
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
    out = Reference()
    x, y, _ = dataset.tensors
    for step in range(steps):
        total = {n: torch.zeros_like(p) for n, p in params.items()}
        for micro in range(accumulate):
            i = step * accumulate + micro
            shards = [sample_indices(r, i, len(dataset), dp=dp, local_batch=LOCAL_BATCH) for r in range(dp)]
            for shard in shards:
                net.zero_grad(set_to_none=True)
                F.mse_loss(net(x[shard]), y[shard]).backward()
                for n, p in params.items():
                    total[n] += p.grad / (accumulate * dp)
            with torch.no_grad():
                every = [i for s in shards for i in s]
                out.losses.append(F.mse_loss(net(x[every]), y[every]).item())
        for n, p in params.items():
            p.grad = total[n]
        out.grads.append({n: g.clone() for n, g in total.items()})
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), clip if clip is not None else float("inf"))
        out.norms.append(norm.item())
        optimizer.step()
    out.state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return out

