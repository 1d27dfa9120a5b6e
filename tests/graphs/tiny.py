"""Tiny reference models and a plain training loop shared by the CPU and GPU CUDA-graph tests.

Import as ``from graphs.tiny import ...`` (``tests/`` is on ``sys.path``; ``graphs`` here is a
namespace package of the test tree, not ``lightning_moe.graphs``).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from lightning_moe import MoEConfig
from lightning_moe.graphs import CUDAGraphManager
from lightning_moe.graphs.cuda_graph import GraphedStage, _Replay
from lightning_moe.models import MoETransformer, MoETransformerConfig

__all__ = ["DROP_AND_PAD", "SCOPE_SETS", "VOCAB", "batches", "stage_results", "tiny_model", "train"]

VOCAB = 64
DROP_AND_PAD = {"capacity_factor": 1.0, "pad_to_capacity": True}

SCOPE_SETS = [
    (("attn",), {}),
    (("moe_router",), {}),
    (("attn", "moe_router"), {}),
    (("moe_router", "moe_preprocess"), {}),
    (("attn", "moe_router", "moe_preprocess"), DROP_AND_PAD),
    (("moe",), DROP_AND_PAD),
    (("attn", "moe"), DROP_AND_PAD),
]
"""(scopes, MoEConfig overrides) exercised on both CPU (emulated) and GPU (real graphs)."""


def tiny_model(
    moe: dict | None = None,
    hidden: int = 32,
    num_layers: int = 2,
    num_experts: int = 4,
    ffn: int = 16,
    seed: int = 0,
    dense: bool = False,
    **model_overrides,
) -> MoETransformer:
    """A small MoE transformer with every router side effect on (aux loss, z-loss, shared expert)."""
    moe_fields = dict(
        hidden_size=hidden, ffn_hidden_size=ffn, num_experts=num_experts, top_k=2,
        load_balancing=["aux_loss", "seq_aux_loss"], aux_loss_coeff=0.01, z_loss_coeff=1e-3,
        shared_expert_ffn_hidden_size=ffn, shared_expert_gate=True,
    )
    moe_fields.update(moe or {})
    fields = dict(
        vocab_size=VOCAB, hidden_size=hidden, num_layers=num_layers, num_attention_heads=4,
        ffn_hidden_size=2 * hidden, max_seq_len=256, qk_norm=True, moe=None if dense else MoEConfig(**moe_fields),
    )
    fields.update(model_overrides)
    torch.manual_seed(seed)
    return MoETransformer(MoETransformerConfig(**fields))


def batches(steps: int, micro: int, batch: int, seq: int, seed: int = 1, device="cpu") -> list[list[Tensor]]:
    """``steps`` lists of ``micro`` token batches ``[batch, seq + 1]``."""
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(0, VOCAB, (batch, seq + 1), generator=g).to(device) for _ in range(micro)] for _ in range(steps)
    ]


def train(
    model: MoETransformer,
    data: list[list[Tensor]],
    scopes: tuple[str, ...] | None = None,
    warmup_steps: int = 2,
    backend: str = "emulate",
    lr: float = 0.05,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[list[float], CUDAGraphManager | None, list[float]]:
    """SGD over ``data`` (gradient accumulation over each step's micro-batches); graphs from ``warmup_steps`` on.

    Returns the per-step losses, the manager (None when eager) and the per-step wall times.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    manager = CUDAGraphManager(model, scopes, backend=backend) if scopes else None
    losses, times = [], []
    device_type = next(model.parameters()).device.type
    for step, micro_batches in enumerate(data):
        if manager is not None and step == warmup_steps - 1:
            manager.start_recording()
        if device_type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        total = 0.0
        for tokens in micro_batches:
            with torch.autocast(device_type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
                loss = model.loss(tokens[:, :-1], tokens[:, 1:]) / len(micro_batches)
            loss.backward()
            total += loss.detach()
        if manager is not None and manager.recording:
            manager.capture()
        optimizer.step()
        optimizer.zero_grad()
        if device_type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(total))
    return losses, manager, times


def stage_results(stage: GraphedStage, replay: bool) -> list[Tensor | None]:
    """One captured stage on its static inputs: its outputs, then the gradients of its differentiable
    inputs and parameters for all-ones output gradients (None where unused); eagerly (``stage.fn``
    in the captured autocast state) or by replaying its forward and backward graphs."""
    user = [t for t in stage._static_inputs if t is not None]
    if replay:
        outputs = list(_Replay.apply(stage, *user, *stage.params))
    else:
        with stage._autocast():
            outputs = [o for o in stage.fn(*stage._static_inputs) if o is not None]
    values = [o.detach().clone() for o in outputs]  # before the backward replay reuses graph memory
    diff = [o for o, needs in zip(outputs, stage._output_diff) if needs]
    wrt = [t for t in user if t.requires_grad] + [p for p in stage.params if p.requires_grad]
    grads = torch.autograd.grad(diff, wrt, [torch.ones_like(o) for o in diff], allow_unused=True)
    return values + [None if g is None else g.detach().clone() for g in grads]
