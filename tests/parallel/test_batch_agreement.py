"""Tensor-parallel ranks must hold the same batch: checked, with the cause named, on every rank.

Unit level: :func:`check_same_batch` on 2 gloo ranks for equal and differing batches (values,
shapes, dtypes, nesting). Trainer level: `MoEStrategy` at TP=2 with a dataset whose random
augmentation is seeded per global rank (what ``seed_everything(workers=True)`` does to workers)
refuses to train on both ranks, and the same data without that randomness trains.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from torch.utils.data import DataLoader, Dataset

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models import MoETransformerConfig
from lightning_moe.parallel.batch_agreement import batch_fingerprint, check_same_batch
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed


def _base_batch() -> dict:
    gen = torch.Generator().manual_seed(5)
    return {"tokens": torch.randint(0, 50, (2, 8), generator=gen), "extra": [torch.randn(3, generator=gen), 7]}


def _variant(batch: dict, rank: int, kind: str) -> dict:
    if rank == 0 or kind == "same":
        return batch
    tokens = batch["tokens"].clone()
    if kind == "one value":
        tokens[1, 3] += 1
    elif kind == "swapped":
        tokens[0, [0, 1]] = tokens[0, [1, 0]]
    elif kind == "shape":
        tokens = tokens[:, :-1]
    elif kind == "dtype":
        tokens = tokens.to(torch.int32)
    elif kind == "negative zero":
        return {"tokens": tokens, "extra": [torch.tensor([-0.0, 0.0, 0.0]), 7]}
    return {"tokens": tokens, "extra": batch["extra"]}


KINDS = ["same", "one value", "swapped", "shape", "dtype", "negative zero"]


def _check_kinds(rank: int, world: int) -> dict[str, str]:
    outcome = {}
    for kind in KINDS:
        batch = _variant(_base_batch(), rank, kind)
        if kind == "negative zero" and rank == 0:
            batch = {"tokens": batch["tokens"], "extra": [torch.zeros(3), 7]}
        try:
            check_same_batch(batch, torch.distributed.group.WORLD)
            outcome[kind] = "ok"
        except ValueError as err:
            outcome[kind] = str(err)
    return outcome


def test_check_same_batch_on_two_ranks(tmp_path):
    for outcome in run_distributed(_check_kinds, 2, tmp_dir=tmp_path):
        assert outcome["same"] == "ok"
        for kind in KINDS[1:]:
            assert "received different batches (global ranks [1] differ from rank 0)" in outcome[kind], kind
            assert "seed_everything(workers=True)" in outcome[kind]


def test_fingerprint_is_deterministic_and_ignores_non_tensors():
    a, b = _base_batch(), _base_batch()
    b["extra"][1] = "not a tensor"
    torch.testing.assert_close(batch_fingerprint(a, torch.device("cpu")), batch_fingerprint(b, torch.device("cpu")))


VOCAB, SEQ = 64, 8


class RankSeededTokens(Dataset):
    """Token sequences; with ``augment``, a random token masked, drawn from a per-rank seed."""

    def __init__(self, augment: bool) -> None:
        self.data = torch.randint(0, VOCAB, (16, SEQ + 1), generator=torch.Generator().manual_seed(0))
        self.augment = augment
        self.gen = torch.Generator().manual_seed(1000 + torch.distributed.get_rank()) if augment else None

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        sample = self.data[index].clone()
        if self.augment:
            sample[torch.randint(0, SEQ, (1,), generator=self.gen)] = 0
        return sample[:-1], sample[1:]


def _fit_tp2(rank: int, world: int, augment: bool) -> str:
    config = MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=1, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        moe=MoEConfig(32, 16, 4, top_k=2),
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=MoEStrategy(tensor_parallel_size=2, expert_parallel_size=1,
                                                               expert_tensor_parallel_size=1),
        max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0,
    )
    try:
        trainer.fit(MoELanguageModel(config), DataLoader(RankSeededTokens(augment), batch_size=2))
    except ValueError as err:
        return str(err)
    return f"trained {trainer.global_step} steps"


@pytest.mark.parametrize("augment", [False, True], ids=["same-data", "rank-seeded-augmentation"])
def test_moe_strategy_refuses_tensor_parallel_ranks_with_different_batches(tmp_path, augment):
    for outcome in run_distributed(_fit_tp2, 2, augment, timeout_s=120, tmp_dir=tmp_path):
        if augment:
            assert "tensor-parallel group [0, 1] received different batches" in outcome
        else:
            assert outcome == "trained 2 steps"


def _count_check_reads_tp2_accumulating(rank: int, world: int) -> tuple[int, int]:
    """(host reads made by the batch check, optimizer steps) of a TP=2 fit accumulating 4 micro-batches."""
    import sys

    import lightning_moe.parallel.batch_agreement as agreement

    reads = [0]
    originals = {name: getattr(torch.Tensor, name) for name in ("__bool__", "item", "tolist")}

    def counting(original):
        def read(self, *args, **kwargs):
            # Only reads made by the check's own module: the loop, the loss and the logging read too.
            if sys._getframe(1).f_code.co_filename == agreement.__file__:
                reads[0] += 1
            return original(self, *args, **kwargs)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    try:
        config = MoETransformerConfig(
            vocab_size=VOCAB, hidden_size=32, num_layers=1, num_attention_heads=4, num_kv_heads=2,
            ffn_hidden_size=64, moe=MoEConfig(32, 16, 4, top_k=2),
        )
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=MoEStrategy(tensor_parallel_size=2, expert_parallel_size=1,
                                                                   expert_tensor_parallel_size=1),
            max_steps=2, accumulate_grad_batches=4, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        )
        trainer.fit(MoELanguageModel(config), DataLoader(RankSeededTokens(False), batch_size=2))
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return reads[0], trainer.global_step


def test_batch_check_reads_the_host_once_per_optimizer_step(tmp_path):
    """Accumulating 4 micro-batches, the check compares on the device and reads the result once per step
    (plus one read for the fit's first micro-batch, checked before its forward)."""
    for reads, steps in run_distributed(_count_check_reads_tp2_accumulating, 2, timeout_s=120, tmp_dir=tmp_path):
        assert steps == 2
        assert reads == steps + 1, f"{reads} host reads by the batch check in {steps} optimizer steps"


class FirstBatchRankSeeded(RankSeededTokens):
    """Only the first two samples loaded (the first micro-batch at batch size 2) are augmented per rank."""

    loaded = 0

    def __getitem__(self, index: int):
        self.loaded += 1
        return super().__getitem__(index) if self.loaded <= 2 else (self.data[index][:-1], self.data[index][1:])


def _fit_tp2_first_micro_batch_differs(rank: int, world: int) -> tuple[str, int, bool]:
    config = MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=1, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        moe=MoEConfig(32, 16, 4, top_k=2),
    )
    model = MoELanguageModel(config)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=MoEStrategy(tensor_parallel_size=2, expert_parallel_size=1,
                                                               expert_tensor_parallel_size=1),
        max_steps=2, accumulate_grad_batches=4, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0,
    )
    before = None

    class Snapshot(L.Callback):
        def on_train_start(self, trainer, pl_module):
            nonlocal before
            before = [p.detach().clone() for p in pl_module.parameters()]

    trainer.callbacks.append(Snapshot())
    try:
        trainer.fit(model, DataLoader(FirstBatchRankSeeded(True), batch_size=2))
    except ValueError as err:
        unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
        return str(err), trainer.global_step, unchanged
    return "trained", trainer.global_step, False


def test_a_differing_early_micro_batch_raises_before_the_optimizer_step(tmp_path):
    for message, steps, unchanged in run_distributed(_fit_tp2_first_micro_batch_differs, 2, timeout_s=120,
                                                     tmp_dir=tmp_path):
        assert "tensor-parallel group [0, 1] received different batches" in message
        assert "seed_everything(workers=True)" in message
        assert (steps, unchanged) == (0, True), "the optimizer stepped on the differing batches"


class RankLengthTokens(RankSeededTokens):
    """Sequences one token shorter on rank 1: batches of another shape, which the TP collectives cannot run."""

    def __getitem__(self, index: int):
        inputs, targets = super().__getitem__(index)
        cut = SEQ - torch.distributed.get_rank()
        return inputs[:cut], targets[:cut]


def _fit_tp2_shapes_differ(rank: int, world: int) -> tuple[str, int]:
    config = MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=1, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        moe=MoEConfig(32, 16, 4, top_k=2),
    )
    model = MoELanguageModel(config)
    forwards = [0]
    model.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + 1))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=MoEStrategy(tensor_parallel_size=2, expert_parallel_size=1,
                                                               expert_tensor_parallel_size=1),
        max_steps=2, accumulate_grad_batches=4, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0,
    )
    try:
        trainer.fit(model, DataLoader(RankLengthTokens(False), batch_size=2))
    except Exception as err:  # any error: the test asserts which one it is
        return f"{type(err).__name__}: {err}", forwards[0]
    return "trained", forwards[0]


def test_the_first_micro_batch_of_a_fit_is_checked_before_its_forward(tmp_path):
    """Batches whose shapes differ across TP ranks (the usual systematic cause) are refused before any
    forward runs: the step-end read alone would let the TP collectives meet mismatched tensors first."""
    for message, forwards in run_distributed(_fit_tp2_shapes_differ, 2, timeout_s=60, tmp_dir=tmp_path):
        assert "tensor-parallel group [0, 1] received different batches" in message, message
        assert forwards == 0, f"{forwards} forward(s) ran on the differing batches"
