"""What only a GPU shows of a rank at scale, on one GPU: its setup peak and FSDP2's prefetch overlap.

One process plays rank 0 of a world of 8 on torch's fake process group (collectives return at
once, nothing is communicated) with real CUDA tensors, so the caching allocator and the CUDA
streams are the real ones. ``benchmarks/gpu_check.sh`` runs these (``gpu`` marker); the CPU
counterparts are ``tests/scale/`` (fake tensors: bytes and collectives, no streams) and the
FSDP2 root/prefetch-order tests of ``tests/parallel``.

* Setup: a model built on the meta device, parallelised (TP=2, EP=4) and materialised on the GPU
  holds its shards and nothing else, and its peak ``torch.cuda.max_memory_allocated`` during
  materialisation is at most the shards plus one local tensor: every layer draws its full initial
  values on the host, and only this rank's block is copied to the device
  (``parallel/sharded_init.py``'s ``write_sharded``), so nothing of a weight's global size ever
  lands there (the CPU scale tests bound the host side: the shard plus one drawn tensor).
* FSDP2 prefetch: under ``FULL_SHARD`` (world 8, DP=8) each block's all-gather is prepared
  (FSDP2's copy-in, on its own stream) while the previous block still computes: the model is the
  one FSDP2 root (its streams serve every unit) and each block prefetches the next one's
  all-gather at its start (``parallel/fsdp_root.py``). A fake all-gather
  moves nothing, but FSDP2 still runs its copy-in and copy-out kernels on its streams at world 8
  (at world 1 it skips the all-gather path, so a plain one-GPU run shows no overlap at all). The
  CPU cannot show this: it has no streams. What a real multi-GPU run adds (NCCL kernels and
  bandwidth) is not shown either.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize
from lightning_moe.strategies.model_setup import materialize

pytestmark = pytest.mark.gpu

WORLD = 8
ALLOCATOR_ROUNDING = 512
"""The CUDA caching allocator rounds every allocation up to a multiple of 512 bytes."""


@pytest.fixture
def fake_world_on_gpu():
    """Rank 0 of a fake world of `WORLD` whose collectives take CUDA tensors."""
    torch.cuda.set_device(0)
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()
    torch.cuda.empty_cache()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _largest_local_tensor(model: torch.nn.Module) -> int:
    """Bytes of the largest tensor this rank holds of the parallelised ``model`` (a DTensor's local
    shard): the most a copy of drawn values to the device may stage beside the shards (a
    contiguous copy of a block, where its destination is not contiguous)."""
    return max(_local(p).numel() * p.element_size() for p in (*model.parameters(), *model.buffers()))


def test_setup_peak_is_the_shard_plus_one_tensor(fake_world_on_gpu):
    """TP=2, EP=4 (DP=4, EDP=2) on rank 0 of 8: after ``materialize`` the GPU holds exactly this
    rank's parameters and buffers (up to the allocator's rounding), and the peak while they were
    initialised exceeds that by at most one local tensor (module docstring). A global copy of the
    embedding (twice its TP=2 shard, the largest local tensor) on the device would exceed it."""
    config = MoETransformerConfig(
        vocab_size=32000, hidden_size=1024, num_layers=4, num_attention_heads=8, num_kv_heads=4,
        ffn_hidden_size=2816, first_dense_layers=1, max_seq_len=2048,
        moe=MoEConfig(hidden_size=1024, ffn_hidden_size=704, num_experts=16, top_k=2, shared_expert_ffn_hidden_size=704),
    )
    with torch.device("meta"):
        model = MoETransformer(config)
    ctx = build_parallel_context(ParallelDims(world_size=WORLD, tp=2, ep=4, etp=1), "cuda")
    parallelize(model, ctx)
    largest = _largest_local_tensor(model)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    materialize(model, torch.device("cuda", torch.cuda.current_device()))
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    tensors = [_local(t) for t in (*model.parameters(), *model.buffers())]
    assert all(t.device.type == "cuda" for t in tensors)
    shard = sum(t.numel() * t.element_size() for t in tensors)
    rounding = ALLOCATOR_ROUNDING * len(tensors)
    assert shard <= held <= shard + rounding, (held, shard)
    assert peak <= shard + largest + rounding + ALLOCATOR_ROUNDING, (
        f"setup peak {peak / 2**20:.1f} MiB > shard {shard / 2**20:.1f} MiB + one local tensor {largest / 2**20:.1f} MiB"
    )


class _Timeline:
    """CUDA events around each block's forward compute and each FSDP2 all-gather copy-in."""

    def __init__(self, model: MoETransformer) -> None:
        self.origin = torch.cuda.Event(enable_timing=True)
        self.compute: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}
        self.copy_in: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}
        self._block_of = {id(m): i for i, block in enumerate(model.layers) for m in block.modules()}
        self._handles = []
        for i, block in enumerate(model.layers):
            # Appended after FSDP2's own hooks (it prepends): the start is after the block's
            # unshard (copy-out) was enqueued, the end after its compute.
            self._handles.append(block.register_forward_pre_hook(lambda m, a, i=i: self._mark_compute(i, 0)))
            self._handles.append(block.register_forward_hook(lambda m, a, o, i=i: self._mark_compute(i, 1)))

    def _event(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def _mark_compute(self, block: int, end: int) -> None:
        if end:
            self.compute[block] = (self.compute[block][0], self._event())
        else:
            self.compute[block] = (self._event(), None)

    def foreach_all_gather(self, real):
        """Wrap FSDP2's ``foreach_all_gather``: events on its copy-in stream around the call."""

        def wrapped(fsdp_params, group, async_op, copy_in_stream, *args, **kwargs):
            block = self._block_of.get(id(fsdp_params[0]._module_info.module))
            start = self._event(copy_in_stream)
            result = real(fsdp_params, group, async_op, copy_in_stream, *args, **kwargs)
            if block is not None and block not in self.copy_in:
                self.copy_in[block] = (start, self._event(copy_in_stream))
            return result

        return wrapped

    def ms(self, event: torch.cuda.Event) -> float:
        """Milliseconds from `origin` to ``event``."""
        return self.origin.elapsed_time(event)


def test_fsdp2_prepares_the_next_all_gather_while_a_block_computes(fake_world_on_gpu):
    """FULL_SHARD, world 8 (DP=8), bf16 compute, 4 dense blocks of Mixtral's width, 4 x 4096 tokens
    (each block ~10 ms of GEMMs on an H100/H200, so the host runs ahead of the GPU): for every block
    after the first, FSDP2's copy-in of its all-gather starts on the GPU before the previous
    block's forward compute has ended. The model is the one root: a root's forward makes the
    all-gather streams wait for all compute issued before it, so blocks that were roots of their
    own would serialise copy-in and compute; and each block's explicit prefetch issues the next
    block's all-gather when it starts."""
    config = MoETransformerConfig(
        vocab_size=32000, hidden_size=4096, num_layers=4, num_attention_heads=32, num_kv_heads=8,
        ffn_hidden_size=14336, max_seq_len=4096,
    )
    with torch.device("meta"):
        model = MoETransformer(config)
    ctx = build_parallel_context(ParallelDims(world_size=WORLD), "cuda")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    parallelize(model, ctx, sharding_strategy="FULL_SHARD", mp_policy=policy)
    assert isinstance(model, FSDPModule)  # the root (tests/scale/test_fsdp_units.py checks the prefetch order)
    model.to_empty(device="cuda")  # values do not matter (the all-gathers are fake): no initialisation
    tokens = torch.randint(0, config.vocab_size, (4, 4096), device="cuda")
    timeline = _Timeline(model)
    patched = timeline.foreach_all_gather(_fsdp_param_group.foreach_all_gather)
    with torch.no_grad():
        model(tokens)  # warm-up: FSDP2's lazy init, cuBLAS handles, allocator
        torch.cuda.synchronize()
        timeline.origin.record()
        with mock.patch.object(_fsdp_param_group, "foreach_all_gather", patched):
            model(tokens)
    torch.cuda.synchronize()
    assert sorted(timeline.compute) == sorted(timeline.copy_in) == list(range(config.num_layers))
    late = [
        (i, timeline.ms(timeline.copy_in[i][0]), timeline.ms(timeline.compute[i - 1][1]))
        for i in range(1, config.num_layers)
        if timeline.ms(timeline.copy_in[i][0]) >= timeline.ms(timeline.compute[i - 1][1])
    ]
    assert not late, f"(block, copy-in start ms, previous block's compute end ms): {late}"
