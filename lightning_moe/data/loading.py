"""Data-parallel loading: a training loader that resumes mid-epoch, and validation without drops or repeats.

Training: :class:`ResumableSampler` deals the samples as ``torch``'s ``DistributedSampler`` does
(one permutation per epoch from ``seed + epoch``; replica ``rank`` takes every
``num_replicas``-th index, the list padded by repeating its head to a multiple of
``num_replicas``), and :class:`ResumableLoader` counts the batches it has handed out in the
epoch. Its ``state_dict()`` (``{"epoch", "batches", ...}``) is what Lightning saves in a
checkpoint for a stateful loader; after ``load_state_dict`` the next epoch of that number starts
after the batches already trained on, so a run stopped mid-epoch (SIGTERM, preemption) and
resumed sees exactly the batches the uninterrupted run sees. Lightning restores its own batch
count of the epoch from the same checkpoint and expects the loader to yield the rest.

Validation: :func:`eval_loader` gives every sequence to exactly one data-parallel rank, and pads
each rank to the same number of full batches with rows whose targets are all ``ignore_index``
(:class:`PaddedDataset`): every rank runs the same steps (the collectives of TP/EP/PP need that),
every batch has ``batch_size`` rows (pipeline micro-batches need that), and a token-weighted loss
counts each target once whatever the number of ranks.

No ``lightning`` and no collectives here: the data-parallel rank and size are arguments.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["PaddedDataset", "ResumableLoader", "ResumableSampler", "eval_loader"]


class ResumableSampler(DistributedSampler):
    """``DistributedSampler``'s order (same arguments), able to start an epoch past its first samples.

    :meth:`skip` makes the next iteration of epoch ``epoch`` (set with ``set_epoch``, as Lightning
    does every epoch) leave out this replica's first ``samples`` indices; another epoch ignores it.
    ``len()`` stays the whole epoch's, as Lightning expects of a resumed loader.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self._skip: tuple[int, int] | None = None

    def skip(self, epoch: int, samples: int) -> None:
        """Leave out the first ``samples`` indices of the next iteration, if it is of epoch ``epoch``."""
        self._skip = (epoch, samples)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self._skip = self._skip, None
        if skip is not None and skip[0] == self.epoch:
            indices = indices[skip[1]:]
        return iter(indices)


class ResumableLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableSampler` whose position in the epoch is a state dict.

    Any ``DataLoader`` keyword argument but ``shuffle`` and ``batch_sampler`` (the sampler holds
    the order). Lightning saves :meth:`state_dict` with every checkpoint of a fit and gives it
    back to :meth:`load_state_dict` on resume. (Lightning may rebuild the loader with another
    sampler, e.g. for ``overfit_batches``; it then iterates as a plain ``DataLoader``.)
    """

    def __init__(self, dataset: Dataset, *, sampler: ResumableSampler, **kwargs: Any) -> None:
        super().__init__(dataset, sampler=sampler, **kwargs)
        # The epoch being iterated and the batches handed out in it (what a checkpoint records).
        self._epoch, self._batches = getattr(sampler, "epoch", 0), 0

    def __iter__(self) -> Iterator[Any]:
        if self._pending() is None:  # a new epoch (a restored position is kept until its epoch starts)
            self._epoch, self._batches = getattr(self.sampler, "epoch", 0), 0
        # A generator: nothing is drawn until the first batch is asked for. Lightning creates the
        # iterator before it sets the epoch of a resumed fit; worker processes would draw then.
        return self._iterate()

    def _pending(self) -> tuple[int, int] | None:
        return getattr(self.sampler, "_skip", None)

    def _iterate(self) -> Iterator[Any]:
        pending, epoch = self._pending(), getattr(self.sampler, "epoch", 0)
        batches = pending[1] // self.batch_size if pending is not None and pending[0] == epoch else 0
        self._epoch, self._batches = epoch, batches
        for batch in super().__iter__():  # the sampler consumes the pending skip here
            self._batches += 1
            yield batch

    def _layout(self) -> dict[str, int | None]:
        sampler = self.sampler
        return {"num_replicas": getattr(sampler, "num_replicas", None), "batch_size": self.batch_size,
                "seed": getattr(sampler, "seed", None), "num_samples": len(self.dataset)}

    def state_dict(self) -> dict[str, int | None]:
        """``epoch``, ``batches`` handed out in it, and the layout they count in (replicas, batch size,
        seed, dataset length)."""
        return {"epoch": self._epoch, "batches": self._batches, **self._layout()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Start the epoch ``state["epoch"]``, when it comes next, after its ``state["batches"]`` batches."""
        saved = {key: state.get(key) for key in self._layout()}
        if saved != self._layout():
            changed = ", ".join(f"{k} {saved[k]} -> {v}" for k, v in self._layout().items() if saved[k] != v)
            warnings.warn(
                f"Resuming epoch {state['epoch']} after {state['batches']} batches with another data layout "
                f"({changed}): the batches left are not the ones the saved run would have trained on. Resume with "
                "the same data-parallel size, batch size and seed, or from an end-of-epoch checkpoint, to continue it exactly.",
                stacklevel=2,
            )
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.skip(int(state["epoch"]), int(state["batches"]) * self.batch_size)
        self._epoch, self._batches = int(state["epoch"]), int(state["batches"])


class PaddedDataset(Dataset[tuple[Tensor, Tensor]]):
    """``dataset`` of ``(inputs, targets)`` pairs extended to ``length`` items by padding rows.

    Item ``i < len(dataset)`` is ``dataset[i]``; a padding item has the shape and dtype of
    ``dataset[0]``, inputs ``0`` and targets all ``ignore_index``, so it adds no target to a loss.
    """

    def __init__(self, dataset: Dataset, length: int, ignore_index: int = -100) -> None:
        if length < len(dataset):
            raise ValueError(f"PaddedDataset length {length} is shorter than the dataset's {len(dataset)} items")
        self.dataset, self.length, self.ignore_index = dataset, length, ignore_index

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if index < len(self.dataset):
            return self.dataset[index]
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} is out of range for {self.length} items")
        inputs, targets = self.dataset[0]
        return torch.zeros_like(inputs), torch.full_like(targets, self.ignore_index)


def eval_loader(dataset: Dataset, batch_size: int, num_replicas: int = 1, rank: int = 0,
                ignore_index: int = -100, **kwargs: Any) -> DataLoader:
    """Validation batches of replica ``rank``: every item of ``dataset`` once over all replicas, in order.

    The dataset is padded (:class:`PaddedDataset`) to ``num_replicas * batch_size *
    ceil(len / (num_replicas * batch_size))`` items and dealt like ``DistributedSampler`` without
    shuffle (replica ``rank`` takes items ``rank, rank + num_replicas, ...``), so every replica
    gets the same number of full batches and no item is dropped or repeated. ``kwargs`` go to the
    ``DataLoader`` (e.g. ``num_workers``).
    """
    per_step = num_replicas * batch_size
    padded = PaddedDataset(dataset, per_step * max(1, math.ceil(len(dataset) / per_step)), ignore_index)
    sampler = DistributedSampler(padded, num_replicas=num_replicas, rank=rank, shuffle=False)
    return DataLoader(padded, batch_size=batch_size, sampler=sampler, **kwargs)
