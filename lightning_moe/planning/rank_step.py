"""What one rank held and sent during one planned optimizer step (`RankStep`), and which of its
counts grow in a straight line with the blocks and micro-batches a planning run keeps."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_moe.planning.step_probe import Collective

__all__ = ["LINEAR_FIELDS", "RankStep"]


@dataclass
class RankStep:
    """What one rank held and sent during one optimizer step (bytes of distinct storages)."""

    rank: int
    params_bytes: int
    """The storages behind the rank's parameters (a DTensor's local shard)."""
    grads_bytes: int
    """The storages behind the gradients before the optimizer step (a gradient-sync bucket whole)."""
    optimizer_bytes: int
    """The storages of every optimizer state tensor after the step."""
    peak_bytes: int
    """The largest live bytes during the step, everything the rank holds included."""
    start_bytes: int
    """Live bytes when the step began."""
    dispatch_bytes: int = 0
    """Of the peak, the token dispatchers' buffers (rows sent, received, regrouped), part of `activation_bytes`."""
    collectives: list[Collective] = field(default_factory=list)
    """The collectives this rank issued during the step (none listed for a stage extrapolated from
    runs with fewer blocks: see `cut_blocks`)."""
    host_reads: int = 0
    """Reads of device values by the host during the step (device synchronisations on a GPU)."""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    """The largest live bytes in each phase of the step (``forward``, ``backward``, ``optimizer``, ...)."""
    cut_blocks: dict[int, int] = field(default_factory=dict)
    """Kinds of blocks this run cut (`~lightning_moe.planning.repeated_blocks`): how many the rank holds."""
    stage_signatures: list | None = None
    """Of a run that cuts blocks: every pipeline stage's `~lightning_moe.planning.repeated_blocks.stage_signatures`."""

    @property
    def activation_bytes(self) -> int:
        """``peak_bytes - params_bytes - grads_bytes - optimizer_bytes``: everything else live at the
        peak (activations, temporaries, communication buffers, the batch)."""
        return self.peak_bytes - self.params_bytes - self.grads_bytes - self.optimizer_bytes


LINEAR_FIELDS = ("params_bytes", "grads_bytes", "optimizer_bytes", "start_bytes", "host_reads")
"""The `RankStep` counts that grow in a straight line with the blocks a run keeps and with its
micro-batches per step (the peaks grow per phase, `RankStep.phase_peaks`)."""
