"""Training steps of the real presets on one fake rank: collectives, host reads and bytes per step.

Each layout runs two optimizer steps of two micro-batches (``scale.fake_step.run_fake_steps``:
what ``MoEStrategy`` runs under automatic optimization, bf16-mixed, AdamW, forced-balanced routing,
NO_SHARD data parallelism) as rank 37 of its world, with one batch of 4096 tokens per micro-batch.
The presets are cut to two layers (``num_layers=2``; DeepSeek-V3 keeps one dense layer before
its MoE layer, ``first_dense_layers=1``) so a layout runs in about two CPU seconds: the per-layer
counts and bounds below are per block, so two blocks check the same as sixty.

Expected numbers come from the layout and the config, as the features document them (reasoning
next to each), never from a run. What the CPU cannot show (GPU streams, NCCL bandwidth, the
overlap of communication with compute, allocator fragmentation) is listed in
``scale/fake_step.py``; ``benchmarks/gpu_check.sh`` measures the setup peak and FSDP2 prefetch
overlap on a GPU.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
from scale.fake_step import FakeRun, run_fake_steps
from scale.formula import local_parameters, training_state_bytes
from scale.step_formula import (
    BF16,
    FP32,
    block_activation_bytes,
    block_parameters,
    head_activation_bytes,
    head_parameters,
    largest_local_tensor,
    local_experts_parameters,
    logits_bytes,
    tp_replicated_parameters,
)
from torch.distributed.tensor import DTensor

from lightning_moe.parallel import ParallelDims

RANK = 37
SEQ_LEN = 4096
MICRO_BATCHES = 2
STEPS = 2

# (preset, layout, config overrides): what a user would pick for each model at its scale.
LAYOUTS = [
    ("mixtral_8x7b", ParallelDims(world_size=64, tp=8, ep=8, etp=1), {"num_layers": 2}),
    ("mixtral_8x7b", ParallelDims(world_size=64, tp=8, ep=4, etp=2), {"num_layers": 2}),
    ("qwen3_30b_a3b", ParallelDims(world_size=128, tp=4, ep=32, etp=1), {"num_layers": 2}),
    ("deepseek_v3_style", ParallelDims(world_size=1024, tp=8, ep=64, etp=1), {"num_layers": 2, "first_dense_layers": 1}),
]
IDS = [f"{name}-w{d.world_size}-tp{d.tp}-ep{d.ep}-etp{d.etp}" for name, d, _ in LAYOUTS]
INT64 = 8
SMALL_STATE_BYTES = 64 * 2**10
"""Allowance over the formula for what a rank keeps between steps besides its shards: scalars
(Adam's step counters, the aux-loss scale, the gradient norm) and GradSync's presence flag per
parameter, a few bytes each."""


@functools.cache
def fake_run(index: int) -> FakeRun:
    """The steps of ``LAYOUTS[index]``, run once per session and shared by the tests below."""
    name, dims, overrides = LAYOUTS[index]
    return run_fake_steps(name, dims, RANK, SEQ_LEN, MICRO_BATCHES, STEPS, save_checkpoint=True, **overrides)


def _group(dims: ParallelDims, name: str) -> tuple[int, ...]:
    return tuple(dims.group_of(name, RANK))


def _communicating(dims: ParallelDims, *names: str) -> list[tuple[int, ...]]:
    """The groups of ``names`` that have more than one rank, in order: GradSync and the gradient
    norm issue no collective over a size-1 group (it would be the identity; the context gives such a
    name a communication-free stand-in, no communicator)."""
    return [_group(dims, name) for name in names if len(_group(dims, name)) > 1]


def _moe_layers(run: FakeRun) -> list[int]:
    return [i for i in range(run.sharded.config.num_layers) if run.sharded.config.is_moe_layer(i)]


def expected_block_collectives(run: FakeRun, index: int, backward: bool) -> Counter:
    """Collectives block ``index`` issues per micro-batch, by (kind, group members).

    Forward, from the tensor-parallel plan (``parallel/tensor_parallel.py``): attention gathers
    the sequence (all-gather over TP) and its row-parallel output projection reduce-scatters it
    back; a dense MLP does the same; an MoE layer routes this rank's own slice (nothing over TP).
    From the ``alltoall`` dispatcher (``parallel/dispatchers/alltoall.py``): the counts
    all-gathered over ETP x EP (the sizes), the rows and their probs sent with one all-to-all each
    over EP and returned with one in combine; at ETP > 1 rows and probs all-gathered over ETP and
    the partial outputs reduce-scattered. From the router (``layers/router.py``): one all-reduce
    of the token counts per load-balancing loss, over TP x CP (aux_loss, seq_aux_loss) or
    TP x DP x CP (global_aux_loss).
    Backward: each differentiable collective's adjoint (``parallel/collectives.py``: all-to-all
    with the splits swapped, all-gather <-> reduce-scatter); the counts and the loss statistics
    have none.
    """
    config, dims = run.sharded.config, run.sharded.dims
    tp, ep, etp, etp_ep = (_group(dims, name) for name in ("tp", "ep", "etp", "etp_ep"))
    gather, scatter = ("reduce_scatter", "all_gather") if backward else ("all_gather", "reduce_scatter")
    expected: Counter = Counter()
    if dims.tp > 1:
        expected[gather, tp] += 1  # attention's sequence gather
        expected[scatter, tp] += 1  # its output projection
        if not config.is_moe_layer(index):
            expected[gather, tp] += 1
            expected[scatter, tp] += 1
    if config.is_moe_layer(index):
        if dims.ep > 1:
            expected["all_to_all", ep] += 3  # rows and probs out, rows back
        if dims.etp > 1:
            expected[gather, etp] += 2
            expected[scatter, etp] += 1
        if not backward:
            if len(etp_ep) > 1:
                expected["all_gather", etp_ep] += 1  # the dispatch sizes
            for kind, coeff in config.moe.aux_loss_coeffs.items():
                if coeff > 0:
                    group = _group(dims, "tp_dp_cp" if kind == "global_aux_loss" else "tp_cp")
                    expected["all_reduce", group] += 1
    return expected


def _per_step(counter: Counter) -> Counter:
    return Counter({key: MICRO_BATCHES * n for key, n in counter.items()})


STEP_SITES = ("batch_agreement.py", "grad_sync.py", "grad_norm.py")
LOSS_SITE = "vocab_parallel_loss.py"


def expected_loss_collectives(dims: ParallelDims) -> Counter:
    """Collectives of one micro-batch's loss, by (kind, op, group members, backward).

    Vocabulary-parallel cross-entropy (``parallel/vocab_parallel_loss.py``, Megatron's): under TP
    each rank holds ``V / TP`` columns of the logits, and the loss needs per token the largest
    logit (one all-reduce ``MAX`` over TP) and, stacked in one tensor, the target's shifted logit
    and the sum of exponentials (one all-reduce ``SUM`` over TP). Backward is local (softmax minus
    one-hot on this rank's columns). At TP=1 the head is not sharded and the loss is the plain one."""
    if dims.tp == 1:
        return Counter()
    tp = _group(dims, "tp")
    return Counter({("all_reduce", "max", tp, False): 1, ("all_reduce", "sum", tp, False): 1})


def expected_edge_collectives(dims: ParallelDims) -> Counter:
    """Collectives of one micro-batch outside the blocks and the loss, by (kind, group, backward).

    From the tensor-parallel plan (``parallel/tensor_parallel.py``), at TP > 1: the embedding is
    row-parallel over the vocabulary with a sequence-sharded output (a reduce-scatter over TP; its
    adjoint an all-gather), the head column-parallel with a sequence-sharded input (an all-gather of
    the hidden states over TP; its adjoint a reduce-scatter) and its output left sharded over the
    vocabulary (no gather of the logits)."""
    if dims.tp == 1:
        return Counter()
    tp = _group(dims, "tp")
    return Counter({
        ("reduce_scatter", tp, False): 1, ("all_gather", tp, True): 1,  # the embedding
        ("all_gather", tp, False): 1, ("reduce_scatter", tp, True): 1,  # the head's input
    })


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=IDS)
def test_collectives_per_step_match_the_layout(index):
    """Every collective of a steady-state step (the second) is one the layout implies, over the
    group it implies, as many times as it implies: per micro-batch those of each block
    (``expected_block_collectives``), of the loss (``expected_loss_collectives``), of the embedding
    and the head (``expected_edge_collectives``) and the TP batch check's fingerprint all-gather;
    per step the gradient all-reduce of each reduce group with more than one rank (one bucket each
    here: ``parallel/grad_sync.py``, experts over EDP, TP-sharded weights over DP x CP, the
    others over TP x DP x CP, a world-spanning one being the default group) and the global
    gradient norm's all-reduces (``parallel/grad_norm.py``: over TP for the TP-sharded gradients,
    over ETP x EP for the experts'). Nothing else, in particular nothing over a one-rank group."""
    run = fake_run(index)
    step, dims = run.steps[1], run.sharded.dims
    tp = _group(dims, "tp")
    for i in range(run.sharded.config.num_layers):
        for backward in (False, True):
            got = step.count(module=f"layers.{i}", backward=backward)
            got -= step.count(module=f"layers.{i}", backward=backward, site="grad_sync.py")
            assert got == _per_step(expected_block_collectives(run, i, backward)), (i, backward)
    loss = Counter((c.kind, c.op, c.ranks, c.backward) for c in step.collectives if c.site == LOSS_SITE)
    assert loss == _per_step(expected_loss_collectives(dims))
    assert step.count(site="batch_agreement.py") == (Counter({("all_gather", tp): MICRO_BATCHES}) if dims.tp > 1
                                                     else Counter())
    assert step.count(site="grad_norm.py") == Counter(("all_reduce", g) for g in _communicating(dims, "tp", "etp_ep"))
    reduced = Counter(c.ranks for c in step.collectives if c.site == "grad_sync.py" and c.kind == "all_reduce")
    assert reduced == Counter(_communicating(dims, "edp", "dp_cp", "tp_dp_cp"))
    assert not [c for c in step.collectives if c.site == "grad_sync.py" and c.kind != "all_reduce"]
    sites = (*STEP_SITES, LOSS_SITE)
    outside = [c for c in step.collectives if not (c.module or "").startswith("layers.") and c.site not in sites]
    assert Counter((c.kind, c.ranks, c.backward) for c in outside) == _per_step(expected_edge_collectives(dims))
    assert all(len(c.ranks) > 1 for c in step.collectives), [c for c in step.collectives if len(c.ranks) == 1]


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=IDS)
def test_gradient_all_reduce_covers_each_gradient_once(index):
    """The gradient sync sums each local gradient element exactly once, over its group
    (``parallel/grad_sync.py``): the experts over EDP, the TP-sharded parameters over DP x CP,
    those every TP rank holds whole over TP x DP x CP. Element counts from the config; each
    bucket carries one presence flag per parameter after its gradients."""
    run = fake_run(index)
    config, dims = run.sharded.config, run.sharded.dims
    experts = local_experts_parameters(config, dims)
    replicated = tp_replicated_parameters(config)
    sharded = local_parameters(config, dims) - experts - replicated
    expected = sorted([(_group(dims, "edp"), experts), (_group(dims, "dp_cp"), sharded),
                       (_group(dims, "tp_dp_cp"), replicated)])
    reduced = sorted((c.ranks, c.shape[0]) for c in run.steps[1].collectives if c.site == "grad_sync.py")
    num_params = sum(1 for _ in run.sharded.model.parameters())
    assert [ranks for ranks, _ in reduced] == [ranks for ranks, _ in expected]
    for (_, numel), (_, elements) in zip(reduced, expected):
        assert 0 < numel - elements <= num_params, (numel, elements)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=IDS)
def test_host_reads_per_step(index):
    """The host reads of a step are exactly the documented ones, all in forward:

    * ``alltoall`` dispatcher, dropless: the per-(rank, expert) counts gathered over ETP x EP are
      read once per dispatch, its only device-to-host read (module docstring): once per MoE layer
      and micro-batch (the combine and the backward reuse the sizes; no recompute here);
    * TP batch check (``parallel/batch_agreement.py``, ``strategies/step_safeguards.py``): the
      comparisons stay on the device and are read once per optimizer step, before it; the run's
      first micro-batch is checked at once (one more read, first step only);
    * finite-gradient guard (``strategies/optimizer_step.py``): one read of the global norm per step;
    * gradient sync: none (a read only when some parameter had no gradient here).

    AdamW runs fused, as ``MoELanguageModel`` asks on CUDA (``lit/module.py``
    ``adamw_kernel_options``): its step counters live on the device, so it reads nothing (foreach
    AdamW would read each counter twice, once per bias correction). Any other read fails the step
    itself (``StepProbe`` raises)."""
    run = fake_run(index)
    dispatches = MICRO_BATCHES * len(_moe_layers(run))
    num_params = sum(1 for _ in run.sharded.model.parameters())
    for step, batch_checks in zip(run.steps, (2, 1)):
        sites = Counter(read.site for read in step.host_reads)
        assert sites == {"alltoall.py:_counts": dispatches, "batch_agreement.py:_raise_if_disagree": batch_checks,
                         "optimizer_step.py:check": 1}
        assert not any(read.backward for read in step.host_reads)
        assert step.host_tensor_reads == 0, f"{step.host_tensor_reads} reads of host tensors ({num_params} parameters)"


def _state_bytes(run: FakeRun) -> int:
    """What a rank keeps between steps: fp32 parameters, gradients (GradSync's buckets) and Adam's
    two moments (`training_state_bytes`), and the experts' bf16 weights that bf16-mixed computes
    with (``layers/experts.py`` ``WeightCastCache``: cast once per optimizer step, kept until the
    next step's forward replaces them)."""
    config, dims = run.sharded.config, run.sharded.dims
    return training_state_bytes(local_parameters(config, dims))["total"] + BF16 * local_experts_parameters(config, dims)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=IDS)
def test_state_between_steps_is_the_formula(index):
    """After a step the rank holds its shards' training state and nothing else (`_state_bytes`, up
    to `SMALL_STATE_BYTES`): no activation, gathered weight or communication buffer survives."""
    run = fake_run(index)
    state = run.steps[1].start_bytes
    assert _state_bytes(run) <= state <= _state_bytes(run) + SMALL_STATE_BYTES


def _blocks_bound(run: FakeRun) -> int:
    config, dims = run.sharded.config, run.sharded.dims
    return sum(
        block_activation_bytes(config, dims, i, run.local_tokens) + BF16 * block_parameters(config, dims, i)
        for i in range(config.num_layers)
    )


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=IDS)
def test_blocks_keep_at_most_their_activations(index):
    """What the transformer blocks keep for backward (measured from the embedding's output to the
    final norm's input) is within ``scale/step_formula.py``'s bound for this rank's tokens, plus
    the bf16 copies of the blocks' weights, in the first step (the experts' bf16 weights made) and
    the second (replaced)."""
    run = fake_run(index)
    for step in run.steps:
        assert step.blocks_saved_bytes <= _blocks_bound(run)


def _head_bound(run: FakeRun) -> int:
    """What the final norm, the head and the loss keep (`head_activation_bytes`), plus the bf16 copy
    of the head's weight that autocast computes with and keeps for the input's gradient."""
    config, dims = run.sharded.config, run.sharded.dims
    return head_activation_bytes(config, dims, run.local_tokens) + BF16 * head_parameters(config, dims)


def _forward_backward_bound(run: FakeRun) -> int:
    config, dims = run.sharded.config, run.sharded.dims
    layer = max(block_activation_bytes(config, dims, i, run.local_tokens) for i in range(config.num_layers))
    return (_state_bytes(run) + _blocks_bound(run) + _head_bound(run) + logits_bytes(config, dims, run.local_tokens)
            + layer + FP32 * largest_local_tensor(config, dims))


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=IDS)
def test_forward_backward_peak_within_bound(index):
    """The largest live bytes of a micro-batch's forward and backward are at most: the state
    between steps, the blocks' bound, what the final norm, head and loss keep (`_head_bound`), the
    logits or their gradient beside the loss's kept softmax (``logits_bytes``: one ``[Tg, V/TP]``),
    the gradients of one block's activations in flight (one block's bound) and one fp32 weight
    gradient before it lands in its bucket (the largest local parameter; on this path, the GPU's
    ``grouped_mm`` experts, autograd allocates every weight gradient and GradSync copies it into its
    slot: only the loop kernel writes expert gradients straight into the slots; the embedding's is
    its ``V / TP`` rows, ``test_vocab_parallel_head.py``). The first step's peak (no moments yet)
    is below the second's."""
    run = fake_run(index)
    for step in run.steps:
        peak = max(step.phase_peaks["forward"], step.phase_peaks["backward"])
        bound = _forward_backward_bound(run)
        assert peak <= bound, f"peak {peak / 2**30:.2f} GiB > bound {bound / 2**30:.2f} GiB"


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=IDS)
def test_optimizer_step_transient(index):
    """The gradient guard and AdamW's update add to the state at most one fp32 tensor of the largest
    parameter's size. AdamW runs fused, as ``MoELanguageModel`` asks on CUDA (``MoEStrategy`` runs
    it under ``allow_mixed_tensors``, so DTensors and plain tensors step together): it updates the
    moments and the parameters in place (torch's default there, foreach, would add one fp32 copy of
    every parameter: ``torch._foreach_sqrt(exp_avg_sq)``). The guard squares one gradient at a time
    (``parallel/grad_norm.py``), before the update. Gradients are reduced in
    fp32 with no staging copy (bf16-mixed keeps fp32 parameters, so the buckets are fp32 already).
    The first step also allocates the moments (part of the state)."""
    run = fake_run(index)
    config, dims = run.sharded.config, run.sharded.dims
    # The first step also creates Adam's per-parameter step counters (device scalars: SMALL_STATE_BYTES).
    bound = _state_bytes(run) + FP32 * largest_local_tensor(config, dims) + SMALL_STATE_BYTES
    for step in run.steps:
        assert step.phase_peaks["optimizer"] <= bound


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=IDS)
def test_head_keeps_the_logits_vocabulary_sharded(index):
    """The head's forward gathers its input's sequence (one all-gather over TP of ``H``-wide hidden
    states, no vocabulary-wide tensor) and the loss reduces one or two numbers per token
    (``expected_loss_collectives``): the logits stay sharded over the vocabulary, and the final
    norm, head and loss keep at most `_head_bound` (Megatron's vocab-parallel cross-entropy)."""
    run = fake_run(index)
    config, step = run.sharded.config, run.steps[1]
    sites = (*STEP_SITES, LOSS_SITE)
    gathers = [c for c in step.collectives if not c.backward and c.kind == "all_gather"
               and not (c.module or "").startswith("layers.") and c.site not in sites]
    assert len(gathers) == MICRO_BATCHES
    assert all(c.shape[-1] == config.hidden_size for c in gathers), [c.shape for c in gathers]
    tokens = run.local_tokens * run.sharded.dims.tp
    assert all(c.shape in ((tokens,), (2, tokens)) for c in step.collectives if c.site == LOSS_SITE)
    assert step.head_saved_bytes <= _head_bound(run)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=IDS)
def test_checkpoint_save_gathers_nothing(index):
    """Saving a sharded checkpoint after the steps (``scale/fake_save.py``: the model's and the
    optimizer's state dicts and DCP's save) is no collective (``state_dict()`` never gathers:
    DESIGN's contract; at ETP > 1 the gated fc1's ``[E, 2, F, H]`` layout makes a rank's gate and up
    blocks one plain shard, so its entry and its moments are views), allocates at most one local
    tensor's bytes beyond what the rank holds (the state dicts allocate nothing; DCP's planner
    makes small host index tensors, one int64 per row of a shard's dimension, from torch's DTensor
    offset helper: bounded here by two such index tensors of the longest local dimension, far below
    one copy of any weight), and hands DCP exactly this rank's shards: fp32 parameters and Adam's two
    moments (12 bytes per local parameter), plus scalars and small buffers (Adam's step counters,
    expert biases) within `SMALL_STATE_BYTES`."""
    run = fake_run(index)
    config, dims = run.sharded.config, run.sharded.dims
    assert not run.save.collectives
    longest = max(max((p.to_local() if isinstance(p, DTensor) else p).shape) for p in run.sharded.model.parameters())
    index_bytes = 2 * INT64 * longest + SMALL_STATE_BYTES
    transient = run.save.peak_bytes - run.save.start_bytes
    assert transient <= index_bytes, f"the save allocated {transient} bytes; DCP's index tensors need {index_bytes}"
    shards = 3 * FP32 * local_parameters(config, dims)
    assert shards <= run.save_written_bytes <= shards + SMALL_STATE_BYTES
