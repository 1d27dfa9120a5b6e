"""The output head and the loss keep the logits sharded over the vocabulary at scale.

Each preset is built on the meta device and parallelised as one fake rank of a tensor-parallel
layout (`scale.fake_world`); its final norm and output head run on a sequence-sharded hidden state
of ``SEQ`` tokens, then the model's loss forward and backward, inside a dispatch mode that records
the largest tensor any operation creates. Megatron's vocabulary-parallel cross-entropy holds only
this rank's ``V / TP`` columns of the logits (and their gradient): no tensor may be larger than the
logits shard or the hidden states gathered over the sequence before the head (sequence
parallelism), whichever is larger. A head that gathers the logits makes ``SEQ x V`` elements on
every rank (Qwen3-30B-A3B at 8k tokens: 1.24e9, 5 GB in fp32, and as much again for their
gradient).

What the CPU cannot show: the allocator's peak on a GPU (``torch.cuda.max_memory_allocated``
around the loss at TP > 1), which only a multi-GPU run measures.
"""

from __future__ import annotations

import pytest
import torch
from helpers.recorders import LargestTensor
from scale.fake_world import sharded_preset
from torch.distributed.tensor import DTensor, Shard

from lightning_moe.parallel import ParallelDims
from lightning_moe.planning.fake_world import fake_rank

SEQ = 8192  # the sequence length of the figure

LAYOUTS = [
    ("mixtral_8x7b", ParallelDims(world_size=64, tp=8, ep=8, etp=1)),
    ("qwen3_30b_a3b", ParallelDims(world_size=128, tp=4, ep=32, etp=1)),
    ("deepseek_v3_style", ParallelDims(world_size=1024, tp=8, ep=64, etp=1)),
]


@pytest.mark.parametrize(("name", "dims"), LAYOUTS, ids=[f"{n}-w{d.world_size}-tp{d.tp}" for n, d in LAYOUTS])
def test_logits_and_loss_stay_sharded_over_the_vocabulary(name, dims):
    rank = dims.world_size - 1
    with fake_rank(rank, dims.world_size):
        sharded = sharded_preset(name, dims, rank)
        model, config, tp = sharded.model, sharded.config, dims.tp
        vocab, hidden_size = config.vocab_size, config.hidden_size
        local_hidden = torch.empty(1, SEQ // tp, hidden_size, device="meta", requires_grad=True)
        hidden = DTensor.from_local(local_hidden, sharded.ctx.dense_mesh["tp"], (Shard(1),), run_check=False)
        targets = torch.zeros(1, SEQ, dtype=torch.int64, device="meta")
        bound = SEQ * max(vocab // tp, hidden_size)
        with LargestTensor() as head:
            logits = model.lm_head(model.norm(hidden))
        assert not isinstance(logits, DTensor)
        assert tuple(logits.shape) == (1, SEQ, vocab // tp), f"rank {rank} holds logits of shape {tuple(logits.shape)}"
        assert head.numel <= bound, head.where
        with LargestTensor() as loss:
            total, count = model.loss_sum(logits, targets)
            (total / count).backward()
        assert loss.numel <= bound, loss.where
        assert tuple(local_hidden.grad.shape) == tuple(local_hidden.shape)


@pytest.mark.parametrize(("name", "dims"), LAYOUTS, ids=[f"{n}-w{d.world_size}-tp{d.tp}" for n, d in LAYOUTS])
def test_embedding_gradient_stays_sharded_over_the_vocabulary(name, dims):
    """The input side of the same property: the embedding is sharded over the vocabulary (``V / TP``
    rows per rank, Megatron's vocab-parallel embedding), so its backward needs no tensor larger than
    this rank's rows of the weight gradient or the output gradient gathered over the sequence
    (``SEQ x H``), whichever is larger. A gradient of the whole vocabulary on every rank is
    1.16 GiB in fp32 for Qwen3-30B-A3B and 3.45 GiB for DeepSeek-V3."""
    rank = dims.world_size - 1
    with fake_rank(rank, dims.world_size):
        sharded = sharded_preset(name, dims, rank)
        embed, config = sharded.model.embed, sharded.config
        tokens = torch.zeros(1, SEQ, dtype=torch.int64, device="meta")
        hidden = embed(tokens)
        assert isinstance(hidden, DTensor) and hidden.to_local().shape[1] == SEQ // dims.tp
        bound = max(config.vocab_size // dims.tp, SEQ) * config.hidden_size
        with LargestTensor() as backward:
            hidden.to_local().sum().backward()
        assert backward.numel <= bound, backward.where
        grad = embed.weight.grad
        assert isinstance(grad, DTensor) and grad.placements == (Shard(0),)
        assert tuple(grad.to_local().shape) == (config.vocab_size // dims.tp, config.hidden_size)
