"""`TextDataModule`: text for the reference model, byte-level (no download) or with a Hugging Face tokenizer.

By default it trains on the Python standard library's source files of the running machine (real
text, present everywhere), split deterministically into training and validation documents. Any
file, directory or glob can replace it. Samples are split over the data-parallel replicas (the
strategy's ``distributed_sampler_kwargs``: under ``MoEStrategy`` the dense DP size and rank, so
TP/CP/PP ranks of one replica read the same samples) by the module's own samplers
(:mod:`lightning_moe.data.loading`):

* training shuffles as Lightning's injected ``DistributedSampler`` does (seed: ``seed_everything``'s,
  else 0, plus the epoch), and its position in the epoch is saved in every checkpoint, so a fit
  resumed from a mid-epoch checkpoint (``CheckpointOnSigterm``, ``every_n_train_steps``) trains
  on exactly the batches the uninterrupted fit would;
* validation counts every sequence once, whatever the number of replicas: each replica gets its
  share in order, padded to full batches with rows whose targets are all ignored (``-100``).
"""

from __future__ import annotations

import os

import lightning as L
from torch.utils.data import DataLoader

from lightning_moe.data import (
    ByteTokenizer,
    CorpusSplit,
    HFTokenizer,
    build_datasets,
    is_token_directory,
    split_corpus,
)
from lightning_moe.data.loading import ResumableLoader, ResumableSampler, eval_loader
from lightning_moe.data.token_check import check_batch_token_ids
from lightning_moe.data.token_files import read_token_meta
from lightning_moe.lit.module import IGNORE_INDEX

__all__ = ["TextDataModule"]


class TextDataModule(L.LightningDataModule):
    """Packed next-token samples from text files.

    Args:
        source: a file, a directory or a glob of text files; None = the Python standard library.
        seq_len: tokens per sample.
        batch_size: samples per micro-batch on each data-parallel replica.
        val_fraction: fraction of the documents held out for validation; a single document (one
            file) is cut in two instead, its last lines for validation (see :meth:`split`).
        max_tokens: cap on the tokens read (keeps CPU demos small); None = everything.
        pattern: glob of the files taken from a directory ``source``.
        num_workers: DataLoader worker processes.
        tokenizer: a Hugging Face ``tokenizer.json``, or the model directory holding it (e.g. the
            model's ``init_from``), so a loaded model trains on its own vocabulary; None = the
            byte tokenizer. Needs the ``tokenizers`` library (the ``hf`` extra).
        tokenizer_eos_token: the token ending each document with ``tokenizer`` (default: the
            directory's ``eos_token_id``, else the usual names; see :class:`~lightning_moe.data.HFTokenizer`).

    A ``source`` written by :func:`~lightning_moe.data.pretokenize` is read as memory-mapped token
    files, without tokenizing; its vocabulary size is the one recorded there.

    ``test_dataloader`` and ``predict_dataloader`` give the validation split (the held-out
    documents; there is no third split), so ``Trainer.test`` reports the validation metrics of the
    weights it is given as ``test_loss`` and ``test_ppl``.

    Every batch is checked on the host, before it moves to the device, for ids outside
    ``[0, vocab_size)`` (:meth:`on_before_batch_transfer`): a corpus pre-tokenized with another
    tokenizer fails with the offending id instead of training on it.
    """

    def __init__(
        self,
        source: str | None = None,
        seq_len: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        max_tokens: int | None = None,
        pattern: str = "*.txt",
        num_workers: int = 0,
        tokenizer: str | None = None,
        tokenizer_eos_token: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tokenizer = ByteTokenizer() if tokenizer is None else HFTokenizer(tokenizer, tokenizer_eos_token)
        self.train_set = self.val_set = None

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer (or the pre-tokenized corpus) can emit; the model's vocabulary must be at least this large."""
        if is_token_directory(self.hparams.source):
            return int(read_token_meta(self.hparams.source)["vocab_size"])
        return self.tokenizer.vocab_size

    def split(self) -> CorpusSplit:
        """How ``source`` splits into training and validation for ``val_fraction``, without tokenizing.

        :func:`~lightning_moe.data.split_corpus` (what :meth:`setup` uses): several documents by
        document, a single one cut at a line boundary near ``1 - val_fraction`` of its text. Its
        ``num_documents`` and ``by`` say what happens; raises ``FileNotFoundError`` for a missing
        or empty source and ``ValueError`` for an invalid ``val_fraction``, a document too short
        to cut, or a pre-tokenized ``source`` (its split was fixed by ``pretokenize``).
        """
        return split_corpus(self.hparams.source, self.hparams.val_fraction, self.hparams.pattern)

    def setup(self, stage: str | None = None) -> None:
        """Read and tokenize the corpus (deterministic, identical on every rank)."""
        if self.train_set is None:
            hp = self.hparams
            self.train_set, self.val_set = build_datasets(
                hp.source, hp.seq_len, hp.val_fraction, hp.max_tokens, self.tokenizer, pattern=hp.pattern
            )

    def _data_parallel(self) -> tuple[int, int]:
        """``(replicas, rank)`` of this process: the strategy's sampler arguments, ``(1, 0)`` without a
        parallel strategy (or a trainer)."""
        trainer = self.trainer
        kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
        return (int(kwargs["num_replicas"]), int(kwargs["rank"])) if kwargs else (1, 0)

    def train_dataloader(self) -> ResumableLoader:
        """This replica's shuffled training batches (the last partial batch dropped), resumable mid-epoch.

        The order is Lightning's ``DistributedSampler``'s for the seed of ``seed_everything``
        (``PL_GLOBAL_SEED``, else 0), at any number of replicas (one included); the loader's
        position in the epoch goes into checkpoints (:class:`~lightning_moe.data.loading.ResumableLoader`).
        """
        replicas, rank = self._data_parallel()
        sampler = ResumableSampler(
            self.train_set, num_replicas=replicas, rank=rank, shuffle=True, seed=int(os.getenv("PL_GLOBAL_SEED", 0))
        )
        return ResumableLoader(
            self.train_set, sampler=sampler, batch_size=self.hparams.batch_size, drop_last=True,
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> DataLoader | list:
        """This replica's validation batches, in order (none when ``val_fraction`` is 0).

        Every sequence is in exactly one replica's batches; the replicas' last batches are padded
        to ``batch_size`` rows whose targets are all ``-100`` (ignored), so each runs the same
        number of full batches (see :func:`~lightning_moe.data.loading.eval_loader`).
        """
        if self.val_set is None:
            return []
        replicas, rank = self._data_parallel()
        return eval_loader(
            self.val_set, self.hparams.batch_size, replicas, rank, IGNORE_INDEX, num_workers=self.hparams.num_workers
        )

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        """Refuse a batch with a token id outside ``[0, vocab_size)`` (on the host: these are CPU
        tensors, so no device synchronisation), naming it and its position."""
        stage = self.trainer.state.stage if self.trainer is not None else None  # "train", "validate", ...
        check_batch_token_ids(batch, self.vocab_size, getattr(stage, "value", None) or "data")
        return batch

    def _held_out(self, stage: str) -> None:
        # No third split: the held-out documents are the only text the model did not train on.
        if self.val_set is None:
            raise ValueError(
                f"TextDataModule's {stage} data are the held-out (validation) documents, but val_fraction=0 holds "
                "none out; set data.val_fraction > 0 (e.g. 0.05)."
            )

    def test_dataloader(self) -> DataLoader:
        """The validation samples (``Trainer.test`` reports ``test_loss``/``test_ppl`` on the held-out documents)."""
        self._held_out("test")
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """Every validation sample (the last batch may be smaller), as ``(inputs, targets)`` batches
        (``Trainer.predict`` uses the inputs)."""
        self._held_out("predict")
        return DataLoader(
            self.val_set, batch_size=self.hparams.batch_size, shuffle=False, drop_last=False,
            num_workers=self.hparams.num_workers,
        )
