"""`MoELanguageModel` under tensor parallelism: validation, test and predict equal one process.

The training and evaluation steps keep the logits sharded over the vocabulary (vocabulary-parallel
cross-entropy; ``val_ppl`` and ``test_ppl`` from the losses); ``forward`` and ``Trainer.predict``
gather them. Oracle: the single-process model (same seed, same weights) on the same batches:
``F.cross_entropy`` over every kept target for the losses, ``exp`` of it for the perplexities,
``log_softmax`` of its logits for each predicted batch. One launch of 2 gloo ranks at TP=2 (EP=2
folded, DP=1: both ranks see every batch).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers.dist import run_distributed
from strategies.toy import quiet_trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.lit.module import IGNORE_INDEX
from lightning_moe.models import MoETransformerConfig
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

VOCAB, SEQ, BATCH, BATCHES = 64, 8, 2, 2
TOL = 1e-5  # fp32: the same targets summed in another order
PREDICT_TOL = 1e-5  # fp32 log-probabilities of logits computed with TP's reductions


def _module() -> MoELanguageModel:
    torch.manual_seed(0)
    config = MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        first_dense_layers=1, max_seq_len=SEQ, moe=MoEConfig(32, 16, 4, top_k=2),
    )
    return MoELanguageModel(config)


def _dataset() -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (BATCH * BATCHES, SEQ + 1), generator=torch.Generator().manual_seed(3))
    targets = tokens[:, 1:].clone()
    targets[0, 4:] = IGNORE_INDEX  # padding: left out of the loss and the perplexity
    return TensorDataset(tokens[:, :-1], targets)


def _tp2(rank: int, world: int) -> dict:
    strategy = MoEStrategy(tensor_parallel_size=2, expert_parallel_size=2, expert_tensor_parallel_size=1)
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=world, strategy=strategy))
    module = _module()
    loader = DataLoader(_dataset(), batch_size=BATCH)
    (val,) = trainer.validate(module, loader, verbose=False)
    (test,) = trainer.test(module, loader, verbose=False)
    predictions = trainer.predict(module, DataLoader(_dataset().tensors[0], batch_size=BATCH))
    return {**val, **test, "predictions": predictions}


def test_validation_test_and_predict_at_tp2_equal_one_process(tmp_path):
    module = _module()
    module.configure_model()
    inputs, targets = _dataset().tensors
    with torch.no_grad():
        logits = module(inputs).float()
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    want_logprobs = torch.log_softmax(logits, dim=-1)
    for rank, got in enumerate(run_distributed(_tp2, 2, timeout_s=180, tmp_dir=tmp_path)):
        for name, value in (("val_loss", want), ("val_ppl", want.exp()), ("test_loss", want), ("test_ppl", want.exp())):
            torch.testing.assert_close(torch.tensor(got[name]), value, rtol=TOL, atol=TOL, msg=f"rank {rank} {name}")
        predicted = torch.cat(got["predictions"])
        assert predicted.shape == (BATCH * BATCHES, SEQ, VOCAB), f"rank {rank}: {tuple(predicted.shape)}"
        torch.testing.assert_close(predicted, want_logprobs, rtol=PREDICT_TOL, atol=PREDICT_TOL)
