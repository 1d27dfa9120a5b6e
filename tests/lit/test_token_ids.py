"""Token ids outside the vocabulary fail with the id, its position and ``vocab_size``, in every layout.

Oracles: the id planted in the batch (its value and position are known), and training at TP=2,
where the vocabulary-parallel embedding would otherwise give it a zero row and train on. The
model checks the first batch of each stage (``check_every_batch`` checks all); the data module
checks every batch it collates, on the host.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from torch.utils.data import DataLoader

from lightning_moe import MoEConfig
from lightning_moe.data.token_check import TokenIdError
from lightning_moe.lit import MoELanguageModel, TextDataModule
from lightning_moe.models import MoETransformerConfig
from lightning_moe.strategies import MoEStrategy

VOCAB, SEQ, BAD_ID = 64, 8, 70
BIG_VOCAB = 320  # fits the byte tokenizer's 259 ids
BAD_AT = (1, 5)  # sample, position of the planted id


def _module(vocab_size: int = VOCAB, **kwargs) -> MoELanguageModel:
    torch.manual_seed(0)
    config = MoETransformerConfig(
        vocab_size=vocab_size, hidden_size=32, num_layers=1, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        max_seq_len=16, moe=MoEConfig(32, 16, 4, top_k=2),
    )
    return MoELanguageModel(config, warmup_steps=1, **kwargs)


def _batch(bad_inputs: bool = False, bad_targets: bool = False, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    inputs, targets = torch.randint(0, VOCAB, (2, 2, SEQ), generator=gen)
    if bad_inputs:
        inputs[BAD_AT] = BAD_ID
    if bad_targets:
        targets[BAD_AT] = BAD_ID
    return inputs, targets


def _trainer(**kwargs) -> L.Trainer:
    kwargs.setdefault("accelerator", "cpu")
    kwargs.setdefault("devices", 1)
    return L.Trainer(
        max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, **kwargs,
    )


MESSAGE = rf"token id {BAD_ID} at position \[1, 5\] .*outside the vocabulary \[0, vocab_size={VOCAB}\).*vocab_size >= 71"


def test_an_out_of_range_input_id_fails_training_with_the_id_position_and_vocab_size():
    with pytest.raises(TokenIdError, match="training batch 0 inputs: " + MESSAGE):
        _trainer().fit(_module(), DataLoader([_batch(bad_inputs=True)], batch_size=None))


def test_an_out_of_range_target_fails_validation_and_ignored_targets_pass():
    inputs, targets = _batch(bad_targets=True)
    targets[0, 0] = -100
    with pytest.raises(TokenIdError, match="validation batch 0 targets: " + MESSAGE):
        _trainer().validate(_module(), DataLoader([(inputs, targets)], batch_size=None), verbose=False)


def test_only_the_first_batch_of_a_stage_is_checked_unless_check_every_batch():
    for every, raises in ((False, False), (True, True)):
        module = _module(check_every_batch=every)
        module.check_token_ids(_batch(), "training", 0)
        if raises:
            with pytest.raises(TokenIdError, match="training batch 1 inputs: " + MESSAGE):
                module.check_token_ids(_batch(bad_inputs=True), "training", 1)
        else:
            module.check_token_ids(_batch(bad_inputs=True), "training", 1)  # no host read: not checked
        module.check_token_ids(_batch(), "validation", 0)  # a stage of its own
        module.setup("fit")  # a new Trainer call checks its first batches again
        with pytest.raises(TokenIdError):
            module.check_token_ids(_batch(bad_inputs=True), "training", 0)


def _text_data(tmp_path) -> TextDataModule:
    """The corpus ``tmp_path / "a.txt"`` (written once, before the ranks start: a rank truncating it
    while another reads it made that rank's corpus empty)."""
    data = TextDataModule(str(tmp_path / "a.txt"), seq_len=SEQ, batch_size=2, val_fraction=0.0)
    data.setup("fit")
    tokens = data.train_set.tokens
    tokens[tokens == ord(" ")] = BIG_VOCAB - 1  # in every sample: a corpus pre-tokenized with a larger vocabulary than the tokenizer's
    return data


def test_the_data_module_refuses_a_batch_with_an_id_past_its_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, " * 40)
    data = _text_data(tmp_path)
    batch = next(iter(data.train_dataloader()))
    with pytest.raises(TokenIdError, match=rf"a data batch's inputs: token id 319 .*vocab_size={data.vocab_size}\)"):
        data.on_before_batch_transfer(batch, 0)  # what the Trainer calls on the host for each batch


def _fit_tp2(rank: int, world: int, tmp: str) -> dict:
    messages = {}
    strategy = dict(tensor_parallel_size=2, expert_tensor_parallel_size=1)
    with pytest.raises(TokenIdError, match="training batch 0 inputs: " + MESSAGE) as err:
        _trainer(devices=world, strategy=MoEStrategy(**strategy)).fit(
            _module(), DataLoader([_batch(bad_inputs=True)] * 2, batch_size=None)
        )
    messages["model"] = str(err.value)

    with pytest.raises(TokenIdError, match=r"a train batch's inputs: token id 319") as err:
        _trainer(devices=world, strategy=MoEStrategy(**strategy)).fit(_module(BIG_VOCAB), datamodule=_text_data(Path(tmp)))
    messages["data"] = str(err.value)
    return messages


@pytest.mark.distributed
def test_out_of_range_ids_fail_at_tp2_instead_of_training_on_zero_embeddings(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello world, " * 40)
    results = run_distributed(_fit_tp2, 2, str(tmp_path / "corpus"), timeout_s=120, tmp_dir=tmp_path)
    assert results[0] == results[1]
