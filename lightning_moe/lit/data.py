"""`TextDataModule`: text for the reference model, byte-level (no download) or with a Hugging Face tokenizer.

By default it trains on the Python standard library's source files of the running machine (real
text, present everywhere), split deterministically into training and validation documents. Any
file, directory or glob can replace it. Samples are split over data-parallel replicas by the
distributed sampler Lightning injects (``MoEStrategy`` gives it the dense DP size and rank).
"""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader

from lightning_moe.data import ByteTokenizer, HFTokenizer, build_datasets, is_token_directory
from lightning_moe.data.token_check import check_batch_token_ids
from lightning_moe.data.token_files import read_token_meta

__all__ = ["TextDataModule"]


class TextDataModule(L.LightningDataModule):
    """Packed next-token samples from text files.

    Args:
        source: a file, a directory or a glob of text files; None = the Python standard library.
        seq_len: tokens per sample.
        batch_size: samples per micro-batch on each data-parallel replica.
        val_fraction: fraction of the documents held out for validation.
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

    def setup(self, stage: str | None = None) -> None:
        """Read and tokenize the corpus (deterministic, identical on every rank)."""
        if self.train_set is None:
            hp = self.hparams
            self.train_set, self.val_set = build_datasets(
                hp.source, hp.seq_len, hp.val_fraction, hp.max_tokens, self.tokenizer, pattern=hp.pattern
            )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training samples (the distributed sampler keeps the shuffle, seeded)."""
        return DataLoader(
            self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True,
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> DataLoader | list:
        """Validation samples in order (none when ``val_fraction`` is 0)."""
        if self.val_set is None:
            return []
        return DataLoader(
            self.val_set, batch_size=self.hparams.batch_size, shuffle=False, drop_last=True,
            num_workers=self.hparams.num_workers,
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
