"""`PipelineRunner` (no Lightning) against one process, for every schedule.

Oracle: the unsplit model on one process, the same batch as ``M`` micro-batches of gradient
accumulation (each micro-batch's loss and aux/z-loss gradient scale divided by ``M``). On 2 forked
gloo ranks (PP=2) with ``M=4``, aux loss, global aux loss, z loss and the expert bias on, every
schedule must give the same per-batch loss on both ranks, the same gradient of every parameter a
rank holds, the same expert-bias token counts (each micro-batch counted once), and each rank must
hold exactly its stages' parameters under their global names. Plus the splitting arithmetic and
the refusals, without processes.
"""

from __future__ import annotations

import pytest
import torch
from helpers.dist import run_distributed
from torch import nn

from lightning_moe import MoEConfig
from lightning_moe.layers.loss_scale import set_aux_loss_scale
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.models.transformer import next_token_loss
from lightning_moe.parallel import ParallelDims, build_parallel_context
from lightning_moe.parallel.grad_sync import GradSync
from lightning_moe.parallel.pipeline.runner import PIPELINE_SCHEDULES, PipelineRunner, check_pipeline_options
from lightning_moe.parallel.pipeline.split import layer_split, pipeline_parts_of, stage_indices

M = 4
BATCH, SEQ = 8, 8
SCHEDULES = list(PIPELINE_SCHEDULES)


def config(tie: bool = False) -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=4, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        first_dense_layers=1, max_seq_len=SEQ, tie_embeddings=tie,
        moe=MoEConfig(
            32, 16, 4, top_k=2, score_func="sigmoid", expert_bias=True, bias_update_rate=1e-2,
            load_balancing=["aux_loss", "global_aux_loss"], aux_loss_coeff=[1e-1, 1e-1], z_loss_coeff=1e-1,
        ),
    )


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1], tokens[:, 1:]


def _counts(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith("local_tokens_per_expert")}


def reference() -> dict:
    torch.manual_seed(0)
    model = MoETransformer(config())
    set_aux_loss_scale(model, 1.0 / M)
    inputs, targets = batch()
    losses = []
    for x, y in zip(inputs.chunk(M), targets.chunk(M)):
        loss = next_token_loss(model(x), y)
        (loss / M).backward()
        losses.append(loss.detach())
    return {
        "loss": torch.stack(losses).mean(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "counts": _counts(model),
    }


def _pipeline(rank: int, world_size: int) -> dict:
    ctx = build_parallel_context(ParallelDims(world_size, pp=2), "cpu")
    out = {}
    for name in SCHEDULES:
        torch.manual_seed(0)
        model = MoETransformer(config())
        runner = PipelineRunner(model, ctx, name, M, next_token_loss, torch.device("cpu"))
        sync = GradSync(model, ctx, explicit_backward=True)
        set_aux_loss_scale(model, 1.0)
        inputs, targets = batch()
        loss = runner.step(inputs, targets, sync)
        out[name] = {
            "loss": loss, "stages": runner.stage_ids,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "params": sorted(n for n, _ in model.named_parameters()),
            "counts": _counts(model),
            "eval": runner.eval(inputs, targets),
            "outputs_kept": _outputs_kept(runner),
        }
    return out


def _outputs_kept(runner: PipelineRunner) -> int:
    """Micro-batch outputs the stages of ``runner``'s schedules still hold after a step or evaluation.

    A schedule asked to return its outputs keeps every micro-batch's head output (the last
    stage's logits, M times) until the next step; neither training nor evaluation needs them."""
    stages = []
    for schedule in runner._schedules.values():  # torch keeps one stage or a list of them
        stages += getattr(schedule, "_stages", None) or [schedule._stage]
    return sum(len(stage.output_chunks) for stage in stages)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_pipeline, 2, timeout_s=240, tmp_dir=tmp_path_factory.mktemp("pipeline"))


@pytest.fixture(scope="module")
def want():
    return reference()


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_equals_gradient_accumulation(runs, want, schedule):
    held: set[str] = set()
    for rank, result in enumerate(runs):
        got = result[schedule]
        torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["eval"], want["loss"], rtol=1e-5, atol=1e-6)
        assert set(got["grads"]) == set(got["params"]), f"rank {rank}: a parameter got no gradient"
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, want["grads"][name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
        for name, count in got["counts"].items():
            assert torch.equal(count, want["counts"][name]), (rank, name)
        assert got["outputs_kept"] == 0, f"rank {rank}: {got['outputs_kept']} micro-batch outputs kept after eval"
        assert not held & set(got["params"]), "a parameter lives on both pipeline ranks"
        held |= set(got["params"])
    assert held == set(want["grads"]), "the stages together hold every parameter exactly once"


@pytest.mark.distributed
def test_stage_placement(runs):
    assert [r["1F1B"]["stages"] for r in runs] == [[0], [1]]
    assert [r["Interleaved1F1B"]["stages"] for r in runs] == [[0, 2], [1, 3]]
    assert [r["ZBVZeroBubble"]["stages"] for r in runs] == [[0, 3], [1, 2]]
    # Embedding with the first stage, norm and head with the last.
    assert "embed.weight" in runs[0]["1F1B"]["params"] and "lm_head.weight" in runs[1]["1F1B"]["params"]
    assert "lm_head.weight" in runs[0]["ZBVZeroBubble"]["params"]
    assert "layers.3.attn.q_proj.weight" in runs[1]["1F1B"]["params"]


def test_layer_split_and_indices():
    assert layer_split(5, 2) == [3, 2]
    assert layer_split(4, 2, [1, 3]) == [1, 3]
    with pytest.raises(ValueError, match="summing to the model's 4 blocks"):
        layer_split(4, 2, [2, 3])
    with pytest.raises(ValueError, match="fewer than its 4 pipeline stages"):
        layer_split(3, 4)
    assert stage_indices(0, 4, 2, "loop") == [0, 4]
    assert stage_indices(0, 4, 2, "v") == [0, 7]


def test_refusals():
    with pytest.raises(ValueError, match="choose one of"):
        check_pipeline_options("Looped", 4, None)
    with pytest.raises(ValueError, match="exactly 2 stage"):
        check_pipeline_options("ZBVZeroBubble", 4, 3)
    with pytest.raises(ValueError, match="exactly 1 stage"):
        check_pipeline_options("1F1B", 4, 2)
    assert check_pipeline_options("Interleaved1F1B", None, None) == (1, 2)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="tie_embeddings=False"):
        pipeline_parts_of(MoETransformer(config(tie=True)))
    with pytest.raises(TypeError, match="defines no pipeline_parts"):
        pipeline_parts_of(nn.Linear(2, 2))
