"""`CheckpointMethods`: the checkpoint half of `MoEStrategy`'s Lightning interface.

Lightning asks a strategy for the model and optimizer state, and to save, load and remove
checkpoints; each answer here delegates to the strategy's
:class:`~lightning_moe.strategies.checkpointing.MoECheckpointing` (``self.checkpointing``), which
writes sharded directories or single files for any layout. Pipeline parallelism adds the other
stages' optimizer parameter groups (``self._pipeline``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_moe.strategies.load_errors import describe_allocation_failure

__all__ = ["CheckpointMethods"]


class CheckpointMethods:
    """Mixin of `MoEStrategy`: Lightning's checkpoint hooks, over ``self.checkpointing``."""

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Model state with global keys (expert tensors as global-shape DTensors)."""
        return self.checkpointing.model_state_dict()

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Optimizer state keyed by parameter name, expert moments as global DTensors."""
        state = self.checkpointing.optimizer_state(optimizer)  # under PP: every stage's names (collective)
        return state if self._pipeline is None else self._pipeline.merge_param_groups(state, self.parallel_context)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Sharded directory (DCP shards + ``meta.pt``) written by every rank, or one file."""
        if storage_options is not None:
            raise TypeError("MoEStrategy.save_checkpoint does not take storage_options (it does not use CheckpointIO).")
        self.checkpointing.save(checkpoint, Path(self.broadcast(str(filepath))))

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded directory (any layout) or a single file into the model and optimizers.

        ``weights_only`` (Lightning's flag) governs the pickled metadata: None or True allows only
        plain containers and tensors; False, for checkpoints you trust, allows any object.
        """
        path = Path(self.broadcast(str(checkpoint_path)))
        try:
            return self.checkpointing.load(path, weights_only=weights_only)
        except (MemoryError, RuntimeError) as err:  # the allocator's message names no file
            if (described := describe_allocation_failure(path, err)) is None:
                raise
            raise described from err

    def remove_checkpoint(self, filepath) -> None:
        """Delete a checkpoint and what interrupted saves of it left (rank 0)."""
        if self.is_global_zero:
            self.checkpointing.remove(Path(filepath))

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        """Nothing to do: :meth:`load_checkpoint` loaded the weights in place."""

    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Nothing to do: :meth:`load_checkpoint` loaded the optimizer states in place."""
