"""A user's own model gets every feature it declares in ``parallel_plan()``, and each equals one process.

The model here is not the reference transformer: its own embedding, ``nn.LayerNorm`` s, its own
attention (separate q/k/v projections and a core-attention module of its own), ``MoELayer``
feed-forwards and a linear head. It declares, through
:class:`~lightning_moe.parallel.model_plan.ModelPlan`, its attention for context parallelism
(positions reach a learned position embedding through the ``positions`` keyword), its pipeline
parts, its FSDP2 units, its recompute targets, its CUDA-graph blocks and a tensor-parallel plan
written with torch's ``parallelize_module`` (Megatron-style with sequence parallelism, as
``lightning_moe/models/parallel_plan.py`` does for the reference model).

Oracle: the same model (same seed, hence the same weights) trained by plain PyTorch in one process
on the same global batches; each data-parallel rank sees its own samples (rows ``r::DP``) and the
global loss is the mean over the ranks' equal-sized shards. Per feature one layout on 2 forked gloo
ranks: CP=2, PP=2, FSDP2 (FULL_SHARD) with EP=2, selective recompute with EP=2, CUDA-graph scopes
(emulated capture and replay) with EP=2, and TP=2 with EP=2. Compared: the loss of every step and
every parameter after the last step (fp32; SGD, so parameters move by lr times the gradient).
"""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback
from strategies.toy import quiet_trainer_kwargs
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.callbacks.cuda_graphs import CUDAGraphCapture
from lightning_moe.callbacks.recompute import SelectiveRecompute
from lightning_moe.memory.recompute import RECOMPUTE_MARK
from lightning_moe.parallel.context_parallel.apply import ContextParallelCoreAttention
from lightning_moe.parallel.model_plan import (
    ContextParallelPlan,
    ModelPlan,
    PipelineParts,
    TensorParallelPlan,
    child_names,
)
from lightning_moe.parallel.tensor_parallel import shard_moe_input
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

VOCAB, HIDDEN, HEADS, HEAD_DIM, EXPERTS, FFN, SEQ = 32, 16, 4, 4, 4, 8, 8
WORLD, STEPS, BATCH, LR, SEED = 2, 3, 4, 0.2, 7
LOSS_TOL = 1e-5
"""fp32: the layouts change only the summation order (collectives, chunked attention)."""
PARAM_TOL = 1e-5
"""SGD moves each parameter by LR times its gradient, whose fp32 noise is ~1e-6 here."""


class CoreAttention(nn.Module):
    """The user's causal attention kernel: ``q``, ``k``, ``v`` ``[B, heads, S, D]``."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Multi-head attention; the head count is read from the projections (a TP shard holds fewer)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False) for _ in range(3))
        self.out = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.core = CoreAttention()

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        q, k, v = (p(x).view(batch, seq, -1, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.out(self.core(q, k, v).transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    """Pre-norm block in the shape CUDA-graph scopes capture (``GraphBlock``): attention, then MoE."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(HIDDEN)
        self.attn = Attention()
        self.ffn_norm = nn.LayerNorm(HIDDEN)
        self.ffn = MoELayer(config)

    def attention_residual(self, x: Tensor) -> Tensor:
        return x + self.attn(self.norm1(x))

    def ffn_residual(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        return x + self.ffn(self.ffn_norm(x), padding_mask)

    def forward(self, x: Tensor) -> Tensor:
        return self.ffn_residual(self.attention_residual(x))


class Net(nn.Module):
    """The user's language model and its :class:`ModelPlan`."""

    def __init__(self, num_blocks: int = 2, positions: bool = True) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        config = MoEConfig(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=EXPERTS, top_k=2, init_std=0.2)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(SEQ, HIDDEN) if positions else None
        self.blocks = nn.ModuleList(Block(config) for _ in range(num_blocks))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def embedding(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1]) if positions is None else positions)
        return x

    def forward(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        x = self.embedding(tokens, positions)
        for block in (self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks):
            x = block(x)
        return self.head(self.norm(x))

    def parallel_plan(self) -> ModelPlan:
        blocks = child_names(self, "blocks")
        return ModelPlan(
            context_parallel=ContextParallelPlan(
                attention=tuple(f"{b}.attn.core" for b in blocks), position_kwarg="positions", max_seq_len=SEQ),
            pipeline=lambda: PipelineParts(
                blocks="blocks", first=("embed", "pos"), last=("norm", "head"), embed=self.embedding,
                block=lambda block, x: block(x), head=lambda x: self.head(self.norm(x))),
            fsdp_units=("embed", "pos", *blocks, "norm", "head"),
            recompute={"layernorm": (nn.LayerNorm,), "attention": ("blocks.*.attn",), "core_attn": (CoreAttention,)},
            graph_blocks=blocks,
            tensor_parallel=TensorParallelPlan(apply=self.shard_tensor_parallel, problems=self.tensor_parallel_problems),
        )

    def tensor_parallel_problems(self, tp: int) -> list[str]:
        bad = {name: n for name, n in (("heads", HEADS), ("vocabulary", VOCAB)) if n % tp}
        problems = [f"TP={tp} must divide the {name} ({n})" for name, n in bad.items()]
        return problems + (["learned positions are not sharded"] if self.pos is not None else [])

    def shard_tensor_parallel(self, mesh: DeviceMesh) -> None:
        """Sequence-sharded hidden states between blocks, heads and vocabulary split over TP."""
        plan: dict[str, object] = {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
        for name in child_names(self, "blocks"):
            plan.update({
                f"{name}.norm1": SequenceParallel(), f"{name}.ffn_norm": SequenceParallel(),
                f"{name}.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                f"{name}.attn.q": ColwiseParallel(), f"{name}.attn.k": ColwiseParallel(),
                f"{name}.attn.v": ColwiseParallel(),
                f"{name}.attn.out": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            })
        parallelize_module(self, mesh, plan)
        for block in self.blocks:
            shard_moe_input(block.ffn, mesh)


class LM(L.LightningModule):
    """Next-token loss over ``(inputs, targets)`` batches; ``pipeline_loss`` serves the pipeline schedule."""

    def __init__(self, net: Net) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx: int) -> Tensor:
        inputs, targets = batch
        return self.pipeline_loss(self.net(inputs), targets)

    def pipeline_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        # Every CP chunk and DP shard holds as many targets: the mean of the ranks' means is the global mean.
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def _data() -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (STEPS * BATCH * WORLD, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _shard(step: int, dp_rank: int, dp: int) -> tuple[Tensor, Tensor]:
    """The batch of ``step`` on data-parallel rank ``dp_rank``: rows ``dp_rank::dp`` of the step's global batch."""
    inputs, targets = _data()[step * BATCH * dp:(step + 1) * BATCH * dp]
    return inputs[dp_rank::dp], targets[dp_rank::dp]


def _state(module: nn.Module) -> dict[str, Tensor]:
    return {k.removeprefix("net."): (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in module.state_dict().items()}


@functools.cache  # seeded model, fixed data: the cases with one (blocks, dp, positions) share the run
def reference(num_blocks: int, dp: int, positions: bool) -> dict:
    """One process: SGD on the mean of the ``dp`` shards' losses, step by step."""
    lm = LM(Net(num_blocks, positions))
    optimizer = lm.configure_optimizers()
    losses = []
    for step in range(STEPS):
        shards = [_shard(step, r, dp) for r in range(dp)]
        loss = torch.stack([lm.training_step(shard, step) for shard in shards]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "state": _state(lm)}


class Probe(Callback):
    """Each step's loss averaged over the ranks, and what the features changed in the model."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.seen: dict[str, list[str]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            net = pl_module.net
            self.seen = {
                "cp_attention": [n for n, m in net.named_modules() if isinstance(m, ContextParallelCoreAttention)],
                "fsdp_units": [n for n, m in pl_module.named_modules() if isinstance(m, FSDPModule)],
                "recomputed": [n for n, m in net.named_modules() if getattr(m, RECOMPUTE_MARK, None) is not None],
                "tp_sharded": sorted({n.rsplit(".", 1)[0] for n, p in net.named_parameters()
                                      if isinstance(p, DTensor) and "ffn.experts" not in n}),
            }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        dist.all_reduce(loss)  # under PP every rank holds the last stage's loss already
        self.losses.append(loss.item() / trainer.world_size)


CASES = {
    # name: (strategy options, data-parallel size, blocks, positions, extra callbacks)
    "cp2": (dict(context_parallel_size=2), 1, 2, True, ()),
    "pp2": (dict(pipeline_parallel_size=2, num_microbatches=2), 1, 4, True, ()),
    "fsdp-ep2": (dict(expert_parallel_size=2, sharding_strategy="FULL_SHARD"), 2, 2, True, ()),
    "recompute-ep2": (dict(expert_parallel_size=2), 2, 2, True,
                      (lambda: SelectiveRecompute(modules=["layernorm", "attention"], strict=True),)),
    "graphs-ep2": (dict(expert_parallel_size=2), 2, 2, True,
                   (lambda: CUDAGraphCapture(scopes=["attn", "moe_router"], warmup_steps=1, strict=True, emulate=True),)),
    "tp2-ep2": (dict(tensor_parallel_size=2, expert_parallel_size=2, expert_tensor_parallel_size=1), 1, 2, False, ()),
}


def _fit(name: str) -> dict:
    options, dp, num_blocks, positions, callbacks = CASES[name]
    rank = dist.get_rank()
    lm = LM(Net(num_blocks, positions))
    probe = Probe()
    extra = [make() for make in callbacks]
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=WORLD, strategy=MoEStrategy(**options), max_steps=STEPS, callbacks=[probe, *extra],
        use_distributed_sampler=False))
    batches = [_shard(step, rank % dp, dp) for step in range(STEPS)]
    inputs, targets = (torch.cat(parts) for parts in zip(*batches))
    trainer.fit(lm, DataLoader(TensorDataset(inputs, targets), batch_size=BATCH))
    graphs = extra[0].stats() if name == "graphs-ep2" else {}
    return {"losses": probe.losses, "state": _state(lm), "seen": probe.seen, "graphs": graphs}


def _all(rank: int, world_size: int) -> dict:
    return {name: _fit(name) for name in CASES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ranks = run_distributed(_all, WORLD, timeout_s=300, tmp_dir=tmp_path_factory.mktemp("model_plan"))
    return {name: [r[name] for r in ranks] for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_each_feature_of_the_plan_equals_one_process(runs, name):
    _, dp, num_blocks, positions, _ = CASES[name]
    ref = reference(num_blocks, dp, positions)
    for rank, result in enumerate(runs[name]):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]),
                                   rtol=LOSS_TOL, atol=LOSS_TOL, msg=lambda m, k=rank: f"rank {k} losses: {m}")
        # A pipeline rank holds its own stages only; every other layout holds every parameter.
        assert result["state"].keys() <= ref["state"].keys()
        assert name == "pp2" or result["state"].keys() == ref["state"].keys()
        for key, value in result["state"].items():
            torch.testing.assert_close(value, ref["state"][key], rtol=PARAM_TOL, atol=PARAM_TOL,
                                       msg=lambda m, k=rank, p=key: f"rank {k} {p}: {m}")
    assert not torch.equal(ref["state"]["blocks.0.attn.q.weight"], Net(num_blocks, positions).blocks[0].attn.q.weight)


def test_pipeline_ranks_hold_their_stages(runs):
    first, last = (set(r["state"]) for r in runs["pp2"])
    assert {"embed.weight", "pos.weight", "blocks.0.attn.q.weight", "blocks.1.ffn.router.weight"} <= first
    assert {"head.weight", "norm.weight", "blocks.3.attn.q.weight"} <= last
    assert not first & last


def test_context_parallel_swaps_the_declared_attention(runs):
    for result in runs["cp2"]:
        assert result["seen"]["cp_attention"] == ["blocks.0.attn.core", "blocks.1.attn.core"]


def test_fsdp_units_are_the_declared_modules(runs):
    declared = {f"net.{name}" for name in ("embed", "pos", "blocks.0", "blocks.1", "norm", "head")}
    experts = {"net.blocks.0.ffn.experts", "net.blocks.1.ffn.experts"}  # on the expert mesh
    for result in runs["fsdp-ep2"]:
        assert set(result["seen"]["fsdp_units"]) == {"", *declared, *experts}  # "": the root


def test_recompute_finds_the_declared_modules(runs):
    for result in runs["recompute-ep2"]:
        assert result["seen"]["recomputed"] == [
            f"blocks.{i}.{part}" for i in range(2) for part in ("norm1", "attn", "ffn_norm")] + ["norm"]


def test_graph_scopes_capture_the_declared_blocks(runs):
    for result in runs["graphs-ep2"]:
        stats = result["graphs"]
        assert sorted(stats) == [f"net.blocks.{i}.{scope}" for i in range(2) for scope in ("attn", "moe_router")]
        assert all(s["replays"] == STEPS - 1 and s["eager_fallbacks"] == 0 for s in stats.values()), stats


def test_tensor_parallel_plan_shards_the_declared_modules(runs):
    for result in runs["tp2-ep2"]:
        assert {"embed", "head", "blocks.0.attn.q", "blocks.1.attn.out", "blocks.0.norm1"} <= set(
            result["seen"]["tp_sharded"])
        assert not any(name.endswith("router") for name in result["seen"]["tp_sharded"])
