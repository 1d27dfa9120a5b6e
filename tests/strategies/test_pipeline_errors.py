"""Errors under pipeline parallelism say what happened, on every rank.

On 2 forked gloo ranks, PP=2 (one stage per rank): an empty batch is refused with the batch size
named (it was a reshape error deep in the schedule); when the last stage's loss raises, that rank
raises its own error and the other stage, whose receive fails, says which stage failed and why
(it said "Connection closed by peer"). Oracle: the error each rank raised, against the failure
injected into one rank only.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed
from strategies.toy import quiet_trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models import MoETransformerConfig
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

BATCH, SEQ, VOCAB, M = 4, 4, 32, 2


class LossFailsOnTheLastStage(MoELanguageModel):
    """The reference module whose loss raises on the last stage's rank."""

    def pipeline_loss(self, outputs, targets):
        raise ValueError("loss broke on purpose")


def _validate(cls: type, batches) -> str:
    torch.manual_seed(0)
    config = MoETransformerConfig(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_attention_heads=2,
                                  num_kv_heads=2, ffn_hidden_size=32, max_seq_len=SEQ, moe=MoEConfig(16, 8, 4, top_k=2))
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=2, strategy=MoEStrategy(pipeline_parallel_size=2, num_microbatches=M)))
    try:
        trainer.validate(cls(config), batches, verbose=False)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def _errors(rank: int, world_size: int) -> dict:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    # A collate that kept no sample (e.g. a filter dropped them all).
    empty = DataLoader(TensorDataset(tokens), batch_size=BATCH, collate_fn=lambda _: (tokens[:0], tokens[:0]))
    return {"empty": _validate(MoELanguageModel, empty),
            "stage": _validate(LossFailsOnTheLastStage, DataLoader(TensorDataset(tokens, tokens), batch_size=BATCH)),
            "rank": dist.get_rank()}


def test_pipeline_errors_name_the_batch_and_the_failing_stage(tmp_path):
    first, last = run_distributed(_errors, 2, timeout_s=120, tmp_dir=tmp_path)
    for result in (first, last):
        assert result["empty"].startswith("ValueError: An empty batch (0 samples)"), result["empty"]
    assert last["stage"] == "ValueError: loss broke on purpose", last["stage"]
    assert first["stage"].startswith("PipelineStageError: pipeline stage 1 (rank 1) failed: ValueError: loss broke "
                                     "on purpose"), first["stage"]


def test_a_lost_exchange_without_a_report_names_the_pipeline_peers():
    """A peer killed without a word (no store line): the rank says its exchange broke and whom to look at."""
    from lightning_moe.parallel.pipeline.stage_failure import PipelineStageError, describe_peer_failure

    lost = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:3508")
    error = describe_peer_failure(lost, stages=[1], rank=1, peers=[0], wait_s=0.0)
    with pytest.raises(PipelineStageError, match=r"this rank \(pipeline stage 1, rank 1\) lost an exchange with another "
                                                 r"rank \(RuntimeError: .*Connection closed by peer.*\), and no other "
                                                 r"pipeline stage \(ranks \[0\]\) reported an error"):
        raise error
    assert describe_peer_failure(ValueError("my own loss"), stages=[1], rank=1, peers=[0]) is None
