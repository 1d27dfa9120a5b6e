"""What saving a sharded checkpoint allocates on a fake rank: state dicts and DCP's planning.

`measure_checkpoint_save` does what ``MoEStrategy`` does for a sharded checkpoint
(``strategies/checkpointing.py``): the model's ``state_dict()`` (global keys, expert tensors as
global-shape DTensors), the optimizer's per-parameter state keyed by name with the experts'
moments as global DTensors (``checkpoint.sharded.optimizer_state_dict``), and
``torch.distributed.checkpoint.save`` of both. The storage writer writes nothing: it resolves
every item as ``FileSystemWriter`` does (``planner.resolve_data``, the tensor it would copy to the
host and write) and adds up its bytes. DCP runs with ``no_dist=True``: on the fake backend its
plan exchange (``gather_object``) would return garbage, and its planning reads DeviceMesh
coordinates (host tensors on a real run), so it runs outside ``FakeTensorMode`` on the state
dict's fake tensors. What this cannot show: the writer's host-side staging copies and file I/O,
and the coordinator's global plan (rank 0's metadata for every rank).
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from lightning_moe.checkpoint.sharded import optimizer_state_dict
from lightning_moe.parallel.expert_parallel import ExpertStateConverter
from lightning_moe.parallel.layout.groups import ParallelContext
from lightning_moe.planning.step_probe import StepProbe, StepRecord

__all__ = ["ResolvingWriter", "measure_checkpoint_save"]


class ResolvingWriter(StorageWriter):
    """A DCP storage writer that resolves every item to write and keeps only its size (`written`)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = 0
        """Bytes DCP handed over to be written."""

    def reset(self, checkpoint_id=None) -> None:
        """Nothing to reset."""

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        """Nothing to set up."""

    def prepare_local_plan(self, plan):
        """The plan as it is."""
        return plan

    def prepare_global_plan(self, plans):
        """The plans as they are."""
        return plans

    def write_data(self, plan, planner) -> Future:
        """Resolve each item (what ``FileSystemWriter`` copies to the host) and record its size."""
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            size = data.numel() * data.element_size() if isinstance(data, torch.Tensor) else len(data.getbuffer())
            self.written += size
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=None))
        future: Future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata, results) -> None:
        """Nothing to finish."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        """Any id: nothing is written."""
        return True


def measure_checkpoint_save(
    model: torch.nn.Module, ctx: ParallelContext, optimizer: torch.optim.Optimizer, probe: StepProbe
) -> tuple[StepRecord, int]:
    """Save ``model`` and ``optimizer`` as the strategy does, under ``probe`` (already entered);
    returns the save's record (collectives, live bytes from ``start_bytes`` to ``peak_bytes``) and
    the bytes DCP would write."""
    probe.new_step()
    probe.phase = "save"
    with unset_fake_temporarily():
        converter = ExpertStateConverter(ctx)  # DeviceMesh slicing: host tensors on a real run
    state = {"state_dict": model.state_dict(), "optimizer_0": optimizer_state_dict(model, optimizer, converter)}
    writer = ResolvingWriter()
    with unset_fake_temporarily():
        dcp.save(state, storage_writer=writer, no_dist=True)
    del state
    return probe.new_step(), writer.written
