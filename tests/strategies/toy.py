"""A tiny MoE LightningModule written for one device, its data, and helpers for strategy tests.

Imported by the tests of ``tests/strategies`` as ``from strategies.toy import ...`` (``tests/`` is
on ``sys.path``; ``strategies`` here is a namespace package of the test tree and does not clash
with ``lightning_moe.strategies``).

Everything here is independent of `MoEStrategy`: the single-process oracle
(:func:`reference_run`) is plain PyTorch, and :func:`full_tensors` reassembles a rank's expert
shards with its own gather (only the shard's *position* is read from the parameter's tag).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.parallel import expert_shard

__all__ = [
    "DP",
    "LOCAL_BATCH",
    "ContextProbe",
    "GradRecorder",
    "ToyDataModule",
    "ToyModule",
    "full_tensors",
    "make_dataset",
    "quiet_trainer_kwargs",
    "reference_run",
    "sample_indices",
    "train_loader",
]

IN_FEATURES, HIDDEN, FFN, NUM_EXPERTS, TOP_K, SEQ = 6, 16, 8, 8, 2, 4
DP = 4
"""Dense data-parallel size of every 4-rank layout tested (TP = CP = 1)."""
LOCAL_BATCH = 2
"""Samples per rank and micro-batch (SEQ tokens each)."""
MODEL_SEED = 1234
DATA_SEED = 99


def make_dataset(num_samples: int) -> TensorDataset:
    """Deterministic ``(x [n, SEQ, IN], y [n, SEQ, 1], index [n])`` samples."""
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(num_samples, SEQ, IN_FEATURES, generator=g)
    y = torch.randn(num_samples, SEQ, 1, generator=g)
    return TensorDataset(x, y, torch.arange(num_samples))


def sample_indices(
    dp_rank: int, micro_batch: int, num_samples: int, dp: int = DP, local_batch: int = LOCAL_BATCH, epoch: int = 0
) -> list[int]:
    """Indices of the ``micro_batch``-th batch (``local_batch`` samples) of data-parallel rank ``dp_rank``.

    Lightning always shuffles a *training* loader when it injects its ``DistributedSampler``
    (``_process_dataloader`` passes ``shuffle=True`` for the training stage, seed 0, and the fit
    loop calls ``set_epoch``), whatever the loader's own ``shuffle``. So the shards are torch's
    ``DistributedSampler(num_replicas=dp, rank=dp_rank, shuffle=True, seed=0)``: one permutation of
    the dataset per epoch, rank r taking its positions r, r + dp, ... The union over the ranks of
    their ``m``-th batches is therefore the ``m``-th block of ``dp * local_batch`` positions of
    that permutation, which is also what one process with ``batch_size = dp * local_batch`` sees.
    """
    sampler = DistributedSampler(range(num_samples), num_replicas=dp, rank=dp_rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    order = list(sampler)
    return order[micro_batch * local_batch : (micro_batch + 1) * local_batch]


def make_config(**overrides) -> MoEConfig:
    """The toy MoE layer: swiglu experts, E=8, top-2, seeded random gates (no ties)."""
    kwargs = dict(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=NUM_EXPERTS, top_k=TOP_K, init_std=0.2)
    kwargs.update(overrides)
    return MoEConfig(**kwargs)


class ToyNet(nn.Module):
    """Linear in, two residual MoE layers, linear head: a plain one-device model."""

    def __init__(self, **config_overrides) -> None:
        super().__init__()
        torch.manual_seed(MODEL_SEED)
        self.inp = nn.Linear(IN_FEATURES, HIDDEN)
        self.moe1 = MoELayer(make_config(**config_overrides))
        self.moe2 = MoELayer(make_config(**config_overrides))
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        h = h + self.moe1(h)
        h = h + self.moe2(h)
        return self.head(h)


def loss_fn(pred: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(pred, target)


class ToyModule(L.LightningModule):
    """The one-device LightningModule under test; records each micro-batch's local loss and indices."""

    def __init__(
        self, lr: float = 1e-2, weight_decay: float = 0.01, num_experts: int = NUM_EXPERTS,
        load_balancing: list[str] | None = None, aux_loss_coeff: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = ToyNet(num_experts=num_experts, load_balancing=load_balancing or [], aux_loss_coeff=aux_loss_coeff)
        self.losses: list[float] = []
        self.seen: list[list[int]] = []
        self.configure_model_probe: dict | None = None
        self.after_clipping = None

    def configure_model(self) -> None:
        if hasattr(self.trainer.strategy, "parallel_context"):  # MoEStrategy; the model itself needs nothing
            self.configure_model_probe = probe_strategy(self.trainer.strategy, self.device_mesh)

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        loss = loss_fn(self.net(x), y)
        self.losses.append(loss.item())
        self.seen.append(index.tolist())
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if self.after_clipping is not None:
            self.after_clipping()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


def probe_strategy(strategy, module_mesh=None) -> dict:
    """What user code can read from the strategy at this point (used from configure_model / setup)."""
    ctx = strategy.parallel_context
    mesh = strategy.device_mesh
    return {
        "sizes": {name: ctx.size(name) for name in ("tp", "cp", "dp", "ep", "etp", "edp")},
        "mesh_dim_names": tuple(mesh.mesh_dim_names),
        "mesh_shape": tuple(mesh.shape),
        "module_mesh_is_strategy_mesh": module_mesh is mesh,
        "sampler_kwargs": dict(strategy.distributed_sampler_kwargs),
        "dp_rank": ctx.rank_in("dp"),
    }


class ContextProbe(Callback):
    """Reads the strategy's parallel context and device mesh in ``Callback.setup``."""

    def __init__(self) -> None:
        self.probe: dict | None = None

    def setup(self, trainer, pl_module, stage) -> None:
        self.probe = probe_strategy(trainer.strategy, pl_module.device_mesh)


class GradRecorder(Callback):
    """Records the full gradients (all shards reassembled) at every optimizer step: ``grads`` before
    clipping (``on_before_optimizer_step``), ``clipped`` right after Lightning's clipping (through
    :meth:`ToyModule.configure_gradient_clipping`), i.e. what the optimizer steps with."""

    def __init__(self) -> None:
        self.grads: list[dict[str, Tensor]] = []
        self.clipped: list[dict[str, Tensor]] = []

    def _record(self, into: list, pl_module) -> None:
        into.append(full_tensors(pl_module.net, {n: p.grad for n, p in pl_module.net.named_parameters()}))

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.after_clipping = lambda: self._record(self.clipped, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        pl_module.after_clipping = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._record(self.grads, pl_module)


def _assemble(pieces: list[tuple], global_shape: tuple[int, ...], name: str) -> Tensor:
    """Place every rank's expert block into the global tensor; replicas must agree, no gaps."""
    full = torch.zeros(global_shape)
    written = torch.zeros(global_shape, dtype=torch.bool)
    for offset, ffn_dim, ffn_rank, ffn_size, gated, local in pieces:
        blocks = [(0, local)]  # (global F offset, block)
        if ffn_dim is not None and ffn_size > 1:
            length = global_shape[ffn_dim]
            if gated:
                step = length // 2 // ffn_size
                gate, up = local.chunk(2, dim=ffn_dim)
                blocks = [(ffn_rank * step, gate), (length // 2 + ffn_rank * step, up)]
            else:
                step = length // ffn_size
                blocks = [(ffn_rank * step, local)]
        for start, block in blocks:
            slot = full.narrow(0, offset, block.shape[0])
            mask = written.narrow(0, offset, block.shape[0])
            if ffn_dim is not None and ffn_size > 1:
                slot = slot.narrow(ffn_dim, start, block.shape[ffn_dim])
                mask = mask.narrow(ffn_dim, start, block.shape[ffn_dim])
            if mask.any():
                assert mask.all(), f"{name}: overlapping blocks"
                torch.testing.assert_close(slot, block, rtol=0, atol=0, msg=f"{name}: expert replicas differ")
            slot.copy_(block)
            mask.fill_(True)
    assert written.all(), f"{name}: the ranks' expert blocks do not cover the global tensor"
    return full


def full_tensors(model: nn.Module, tensors: dict[str, Tensor | None]) -> dict[str, Tensor]:
    """``tensors`` (keyed by parameter name, shaped like the local parameter) as global tensors.

    Expert parameters' blocks are gathered from every rank with one ``all_gather_object`` (a
    collective: call on every rank). None entries are left out.
    """
    params = dict(model.named_parameters())
    out: dict[str, Tensor] = {}
    local_pieces: dict[str, tuple] = {}
    for name, value in tensors.items():
        if value is None:
            continue
        value = (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        shard = expert_shard(params[name])
        if shard is None or not dist.is_initialized():
            out[name] = value
        else:
            local_pieces[name] = (shard.expert_offset, shard.ffn_dim, shard.ffn_rank, shard.ffn_size, shard.gated, value)
    if dist.is_initialized():
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, local_pieces)
        for name in local_pieces:
            out[name] = _assemble([pieces[name] for pieces in every], expert_shard(params[name]).global_shape, name)
    return {name: out[name] for name in tensors if name in out}


def quiet_trainer_kwargs(**kwargs) -> dict:
    """Trainer arguments for short CPU runs without progress bars, loggers or summaries."""
    base = dict(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0,
    )
    base.update(kwargs)
    return base


def train_loader(dataset: TensorDataset, batch_size: int = LOCAL_BATCH) -> DataLoader:
    """A plain loader; under the strategy Lightning injects its DistributedSampler (see :func:`sample_indices`)."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


class ToyDataModule(L.LightningDataModule):
    """:func:`make_dataset` as a datamodule (for LightningCLI runs)."""

    def __init__(self, num_samples: int = 32, batch_size: int = LOCAL_BATCH) -> None:
        super().__init__()
        self.num_samples, self.batch_size = num_samples, batch_size

    def train_dataloader(self) -> DataLoader:
        return train_loader(make_dataset(self.num_samples), self.batch_size)


@dataclass
class ReferenceResult:
    """What the single-process oracle produced, per micro-batch / optimizer step."""

    losses: list[float] = field(default_factory=list)
    """Loss of each global micro-batch (the concatenated shards), as one process computes it."""
    grads: list[dict[str, Tensor]] = field(default_factory=list)
    """Full gradients before clipping, per optimizer step."""
    clipped: list[dict[str, Tensor]] = field(default_factory=list)
    """Full gradients after clipping (what the optimizer steps with), per optimizer step."""
    norms: list[float] = field(default_factory=list)
    """Global gradient norm before clipping, per optimizer step."""
    params: dict[str, Tensor] = field(default_factory=dict)
    """Parameters after the last step (as stored: a gated expert fc1 ``[E, 2F, H]``)."""
    state: dict[str, Tensor] = field(default_factory=dict)
    """``state_dict()`` after the last step: the public format (a gated expert fc1 ``[E, 2, F, H]``)."""


def reference_run(
    dataset: TensorDataset, steps: int, accumulate: int = 1, clip: float | None = None,
    lr: float = 1e-2, weight_decay: float = 0.01, **config_overrides,
) -> ReferenceResult:
    """The single-process oracle in plain PyTorch (no Lightning, no strategy).

    Each optimizer step consumes ``accumulate`` global micro-batches of ``DP * LOCAL_BATCH``
    samples, sharded as Lightning's DistributedSampler deals them (:func:`sample_indices`, epoch 0). The gradient is the average over
    micro-batches and data-parallel shards of each shard's own gradient, the shard being run
    through the model on its own: that is the data-parallel objective, and it is also how the
    auxiliary losses are defined upstream (statistics per data-parallel rank, docs/numerics.md §5.4), while
    for the main loss it equals the gradient of the loss over the concatenated global batch (equal
    shard sizes). Clipping uses the norm of the whole model's gradient.
    """
    net = ToyNet(**config_overrides)
    params = dict(net.named_parameters())
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    result = ReferenceResult()
    x, y, _ = dataset.tensors
    for step in range(steps):
        total = {n: torch.zeros_like(p) for n, p in params.items()}
        for micro in range(accumulate):
            i = step * accumulate + micro
            shards = [sample_indices(r, i, len(dataset)) for r in range(DP)]
            for shard in shards:
                # Each shard's full gradient (main loss + the aux losses attached inside the MoE
                # layers, which take their gradient scale from the layer, not from this loss).
                net.zero_grad(set_to_none=True)
                loss_fn(net(x[shard]), y[shard]).backward()
                for n, p in params.items():
                    if p.grad is not None:
                        total[n] += p.grad / (accumulate * DP)
            with torch.no_grad():
                every = [k for s in shards for k in s]
                result.losses.append(loss_fn(net(x[every]), y[every]).item())
        for n, p in params.items():
            p.grad = total[n]
        result.grads.append({n: g.clone() for n, g in total.items()})
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), clip if clip is not None else float("inf"))
        result.norms.append(norm.item())
        result.clipped.append({n: p.grad.detach().clone() for n, p in params.items()})
        optimizer.step()
        optimizer.zero_grad()
    result.params = {n: p.detach().clone() for n, p in net.named_parameters()}
    result.state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return result
