"""Optimizers with torch's multi-tensor kernels step under `MoEStrategy` when DTensors and plain tensors mix.

At TP=2 (EP=2 folded, no sharding) the tensor-parallel weights are DTensors while the expert
shards, the router and the shared expert stay plain tensors, all in the reference model's two
parameter groups. ``foreach=True`` (torch's default on CUDA) and ``fused=True`` run one op over a
whole group, which DTensor refuses for mixed lists; on CPU the default is the per-parameter loop,
so this failure used to show only on a GPU. Only the update runs with mixed kinds allowed: the
hooks before it still see DTensor's check. Oracle: the same fit with ``foreach=False`` (the
loop), from the same seed on the same batches; foreach runs the same arithmetic (equal to the
bit), the fused kernel rounds differently (``FUSED_TOL``).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from strategies.toy import quiet_trainer_kwargs
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models import MoETransformerConfig
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

VOCAB, SEQ, BATCH, STEPS = 64, 8, 2, 2
FUSED_TOL = 1e-6  # fp32 AdamW: the fused kernel's own order of operations, two steps of lr 1e-2


def _mixing_refused(module: torch.nn.Module) -> bool:
    """Whether DTensor refuses an op between a DTensor and a plain tensor here (its check is on)."""
    weight = next(p for p in module.parameters() if isinstance(p, DTensor))
    try:
        torch.add(weight.detach(), torch.zeros_like(weight.to_local()))
    except RuntimeError as error:
        return "mixed torch.Tensor and DTensor" in str(error)
    return False


class _Model(MoELanguageModel):
    def __init__(self, kernel: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kernel = kernel
        self.checked: list[bool] = []
        """Before each optimizer step (after clipping's closure work): was DTensor's check on?"""

    def on_before_optimizer_step(self, optimizer) -> None:
        self.checked.append(_mixing_refused(self))

    def configure_optimizers(self):
        options = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[self.kernel]
        return torch.optim.AdamW(self.parameters(), lr=1e-2, **options)


def _fit(kernel: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    config = MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        first_dense_layers=1, max_seq_len=SEQ, moe=MoEConfig(32, 16, 4, top_k=2, shared_expert_ffn_hidden_size=16),
    )
    module = _Model(kernel, model=config)
    tokens = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(3))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
    strategy = MoEStrategy(tensor_parallel_size=2, expert_parallel_size=2, expert_tensor_parallel_size=1)
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=2, strategy=strategy, max_steps=STEPS))
    trainer.fit(module, loader)
    assert module.checked == [True] * STEPS, f"{kernel}: DTensor's check off in on_before_optimizer_step: {module.checked}"
    return {name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in module.named_parameters()}


def _fits(rank: int, world: int) -> dict:
    results = {}
    for kernel in ("loop", "foreach", "fused"):
        try:
            results[kernel] = _fit(kernel)
        except (RuntimeError, AssertionError) as error:
            results[kernel] = f"{type(error).__name__}: {error}"
    return results


def test_foreach_and_fused_adamw_equal_the_loop_with_mixed_tensor_kinds(tmp_path):
    for rank, got in enumerate(run_distributed(_fits, 2, timeout_s=240, tmp_dir=tmp_path)):
        want = got["loop"]
        assert isinstance(want, dict), f"rank {rank}: {want}"
        for kernel, tol in (("foreach", 0.0), ("fused", FUSED_TOL)):
            params = got[kernel]
            assert isinstance(params, dict), f"rank {rank}, {kernel}: {params}"
            for name, value in params.items():
                torch.testing.assert_close(value, want[name], rtol=tol, atol=tol,
                                           msg=lambda m, n=name, k=kernel, r=rank: f"rank {r}, {k}, {n}: {m}")
