"""Vocabulary-parallel cross-entropy equals the single-device cross-entropy: losses and every gradient.

Oracles: ``F.cross_entropy`` of the whole logits (the function on its own) and the single-device
model on the same batch (the reference transformer at TP=2 with sequence parallelism, EP=2 folded,
whose head keeps the logits sharded over the vocabulary). One launch of 2 gloo ranks runs every
check; each rank reports its worst errors and the parent compares them with the tolerances.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers.asserts import exceeds, worst_error
from helpers.dist import run_distributed
from parallel.parity import note_gradients

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize
from lightning_moe.parallel.grad_sync import GradSync
from lightning_moe.parallel.layout.check import LayoutError, check_model_layout
from lightning_moe.parallel.vocab_parallel_loss import VocabParallelLogits, vocab_parallel_cross_entropy

pytestmark = pytest.mark.distributed

IGNORE = -100
VOCAB, BATCH, SEQ = 64, 2, 8  # VOCAB and SEQ divisible by TP=2
LOSS_TOL = 1e-5  # fp32, the same sums in another order (DESIGN section 4)
GRAD_TOL = 1e-4  # fp32 gradients after the model's backward (DESIGN section 4)
BF16_INPUT_TOL = 1e-5  # bf16 logits, fp32 arithmetic on both sides: only the order of the sums differs
# bf16 gradients: one rounding of an fp32 value of at most 1 in magnitude (8 mantissa bits).
BF16_GRAD_TOL = 2**-8
# The model under CPU bf16 autocast against the fp32 model: every matmul rounds to bf16 (8 bits),
# through 2 layers and the head. Relative: to the loss (~4.2), and to the head gradient's norm.
BF16_MODEL_RTOL = 1e-2


def _config() -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2,
        ffn_hidden_size=64, first_dense_layers=1, qk_norm=True, init_std=0.1,
        moe=MoEConfig(32, 16, 4, top_k=2, shared_expert_ffn_hidden_size=16),
    )


def _function_checks(rank: int, world: int, group, note) -> None:
    """The autograd function against ``F.cross_entropy`` of the whole logits, fp32 and bf16."""
    gen = torch.Generator().manual_seed(1)
    tokens = 40
    logits = torch.randn(tokens, VOCAB, generator=gen) * 4
    targets = torch.randint(0, VOCAB, (tokens,), generator=gen)
    upstream = torch.rand(tokens, generator=gen)  # a weighted sum: each token's gradient scaled differently
    width = VOCAB // world
    columns = slice(rank * width, (rank + 1) * width)
    # ignore_index -100 (padding) and an id in rank 0's slice (a pad token of the vocabulary).
    for ignore, case in ((IGNORE, "ignore -100"), (3, "ignore id 3")):
        case_targets = targets.clone()
        case_targets[::5] = ignore
        for dtype in (torch.float32, torch.bfloat16):
            full = logits.to(dtype, copy=True).requires_grad_()
            mine = full.detach()[:, columns].clone().requires_grad_()
            losses = vocab_parallel_cross_entropy(mine, case_targets, group, ignore_index=ignore)
            (losses * upstream).sum().backward()
            want = F.cross_entropy(full.float(), case_targets, ignore_index=ignore, reduction="none")
            (want * upstream).sum().backward()
            name = f"{case} {dtype}"
            note(f"fn loss {name}", (losses - want).abs().max().item())
            note(f"fn grad {name}", (mine.grad.float() - full.grad[:, columns].float()).abs().max().item())
            note(f"fn grad dtype {name}", float(mine.grad.dtype != dtype))
            note(f"fn ignored loss {name}", losses[case_targets == ignore].abs().max().item())


def _model_checks(rank: int, world: int, note) -> dict:
    ctx = build_parallel_context(ParallelDims(world, tp=2, etp=1, ep=2), "cpu")
    torch.manual_seed(0)
    reference = MoETransformer(_config())
    model = parallelize(copy.deepcopy(reference), ctx)
    sync = GradSync(model, ctx)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, ::3] = IGNORE
    out: dict = {}

    logits = model(inputs)
    out["local logits"] = tuple(logits.shape)
    total, count = model.loss_sum(logits, targets)
    loss = total / count
    loss.backward()
    sync.finish()
    ref_loss = reference.loss(inputs, targets)
    ref_loss.backward()
    note("model loss", abs(loss.item() - ref_loss.item()))
    note("model count", abs(count.item() - (targets != IGNORE).sum().item()))
    note_gradients(note, model, reference)
    with torch.no_grad():
        note("full logits", (model.full_logits(model(inputs)) - reference(inputs)).abs().max().item())

    # A batch whose targets are all ignored: loss 0 (not NaN), the head gets a zero gradient.
    model.zero_grad(set_to_none=True)
    empty = torch.full_like(targets, IGNORE)
    zero = model.loss(inputs, empty)
    zero.backward()
    sync.finish()
    note("all ignored loss", abs(zero.item()))
    note("all ignored head grad", model.lm_head.weight.grad.full_tensor().abs().max().item())

    # CPU bf16 autocast (the product's bf16-mixed): loss and head gradient against the fp32 model.
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_logits = model(inputs)
        bf16_loss = model.loss_sum(bf16_logits, targets)[0] / count
    bf16_loss.backward()
    sync.finish()
    out["bf16 logits dtype"] = str(bf16_logits.dtype)
    out["bf16 loss dtype"] = str(bf16_loss.dtype)
    note("bf16 model loss (relative)", abs(bf16_loss.item() - ref_loss.item()) / abs(ref_loss.item()))
    ref_head = reference.lm_head.weight.grad
    got_head = model.lm_head.weight.grad.full_tensor()
    note("bf16 head grad (relative)", ((got_head - ref_head).norm() / ref_head.norm()).item())
    return out


def _checks(rank: int, world: int) -> dict:
    worst: dict[str, float] = {}

    def note(key: str, err: float) -> None:
        worst[key] = worst_error(worst.get(key, 0.0), err)

    group = build_parallel_context(ParallelDims(world, tp=2), "cpu").group("tp")
    _function_checks(rank, world, group, note)
    out = _model_checks(rank, world, note)
    return {"worst": worst, **out}


def _tolerance(key: str) -> float:
    if key.startswith("fn grad dtype") or key.startswith("fn ignored") or key in ("model count", "all ignored loss",
                                                                                   "all ignored head grad"):
        return 0.0  # exact: dtypes, counts, and the zeros of ignored targets
    if key.startswith("fn loss"):
        return BF16_INPUT_TOL if "bfloat16" in key else LOSS_TOL
    if key.startswith("fn grad"):
        return BF16_GRAD_TOL if "bfloat16" in key else LOSS_TOL
    if key.startswith("bf16"):
        return BF16_MODEL_RTOL
    if key in ("model loss", "full logits"):
        return LOSS_TOL
    return GRAD_TOL  # "grad <parameter>"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_checks, 2, timeout_s=180, tmp_dir=tmp_path_factory.mktemp("vocab_parallel"))


def test_vocab_parallel_loss_and_gradients_equal_single_device(results):
    failures = {
        f"rank {rank}: {key}": err
        for rank, result in enumerate(results)
        for key, err in result["worst"].items()
        if exceeds(err, _tolerance(key))
    }
    assert not failures, failures
    assert any(key.startswith("grad layers.1.ffn.experts") for key in results[0]["worst"])  # every parameter compared


def test_each_rank_holds_its_vocabulary_slice_of_the_logits(results):
    for result in results:
        assert result["local logits"] == (BATCH, SEQ, VOCAB // 2)
        assert result["bf16 logits dtype"] == "torch.bfloat16" and result["bf16 loss dtype"] == "torch.float32"


def test_logits_of_the_wrong_width_or_shape_are_refused():
    class _Mesh:  # the checks run before any collective: a mesh of 2 ranks is all they need
        def size(self) -> int:
            return 2

    with pytest.raises(ValueError, match=r"does not split into 2 equal tensor-parallel slices; pad vocab_size"):
        VocabParallelLogits(_Mesh(), 63)
    logits = VocabParallelLogits(_Mesh(), 64)
    with pytest.raises(ValueError, match=r"this rank's 32 of 64 vocabulary columns \(TP=2\), got logits of shape "
                                         r"\(2, 8, 64\); pass the model's own output"):
        logits.loss_sum(torch.zeros(2, 8, 64), torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"logits \(2, 8, 32\) and targets \(2, 7\)"):
        vocab_parallel_cross_entropy(torch.zeros(2, 8, 32), torch.zeros(2, 7, dtype=torch.int64), group=None)


def test_a_vocabulary_that_does_not_divide_by_tp_is_refused_before_sharding():
    with torch.device("meta"):
        model = MoETransformer(dataclasses.replace(_config(), vocab_size=63))
    with pytest.raises(LayoutError, match=r"Tensor parallel size 2 must divide vocab_size=63; .*pad the vocabulary "
                                          r"to a multiple of TP"):
        check_model_layout(model, ParallelDims(2, tp=2))
