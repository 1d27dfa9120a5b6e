"""`CheckpointOnSigterm`'s per-batch check on one process (the multi-rank runs: tests/strategies/test_sigterm.py).

Oracle: the meta device, where any host read of a tensor raises. A one-process run has nothing
to agree on with other ranks, so the check at every batch end must read no device value (on a GPU
that read would be a host synchronisation per batch); with the signal recorded it saves and stops.
"""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_moe.callbacks import CheckpointOnSigterm


class _Trainer(SimpleNamespace):
    """The parts of a one-device Trainer the callback uses; records the checkpoints it saves."""

    def __init__(self, tmp_path) -> None:
        super().__init__(strategy=SingleDeviceStrategy(device=torch.device("cpu")), checkpoint_callback=None,
                         default_root_dir=str(tmp_path), global_step=3, saved=[])

    def save_checkpoint(self, path) -> None:
        self.saved.append(path)


def test_one_process_batch_end_reads_no_device_value(tmp_path):
    trainer, module = _Trainer(tmp_path), SimpleNamespace(device=torch.device("meta"))
    callback = CheckpointOnSigterm()
    callback.on_train_batch_end(trainer, module, None, None, 0)  # no signal: nothing read, nothing saved
    assert trainer.saved == []
    callback._record(signal.SIGTERM, None)
    with pytest.raises(SIGTERMException) as stop:
        callback.on_train_batch_end(trainer, module, None, None, 1)
    assert stop.value.code == 128 + signal.SIGTERM
    assert trainer.saved == [tmp_path / "checkpoints" / "last.ckpt"]
