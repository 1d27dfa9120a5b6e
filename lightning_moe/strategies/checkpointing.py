"""How `MoEStrategy` writes and reads checkpoints.

Sharded (default): a directory in Lightning's sharded layout, so ``ModelCheckpoint``,
``ckpt_path=`` and top-k pruning work unchanged:

* ``torch.distributed.checkpoint`` shards (written by every rank) holding only tensors:
  ``state_dict`` (the model, expert tensors as global-shape DTensors) and ``optimizer_<i>``
  (per-parameter state keyed by parameter name);
* ``meta.pt`` (rank 0): everything else Lightning saves (loops, callbacks, hyperparameters), the
  optimizers' param groups, and the saving layout under ``"lightning_moe"``.

Loading builds the templates at the *current* layout and lets DCP fill them, so a checkpoint
written at one expert-parallel size resumes at another. ``meta.pt`` is read with
``weights_only=True`` and DCP's metadata with an allowlist: nothing in a checkpoint can run code.

With ``save_distributed_checkpoint=False`` rank 0 writes one ``torch.save`` file of global tensors
(model weights only; optimizer states are not consolidated), e.g. for inference.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.tensor import DTensor

from lightning_moe.parallel.checkpoint import (
    SafeFileSystemReader,
    init_optimizer_state,
    load_optimizer_state_dict,
    optimizer_param_groups,
    optimizer_state_dict,
)
from lightning_moe.parallel.expert_parallel import ExpertStateConverter

if TYPE_CHECKING:
    from lightning_moe.strategies.moe_strategy import MoEStrategy

__all__ = ["MoECheckpointing"]

_LAYOUT_KEY = "lightning_moe"


def _raw(optimizer):
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class MoECheckpointing:
    """The checkpoint half of `MoEStrategy` (see the module docstring)."""

    def __init__(self, strategy: MoEStrategy, save_distributed_checkpoint: bool = True) -> None:
        self.strategy = strategy
        self.sharded = save_distributed_checkpoint

    @property
    def _converter(self) -> ExpertStateConverter:
        return ExpertStateConverter(self.strategy.parallel_context)

    def _layout(self) -> dict[str, Any]:
        dims = self.strategy.parallel_context.dims
        return {
            "world_size": dims.world_size, "tp": dims.tp, "cp": dims.cp, "pp": dims.pp, "ep": dims.ep,
            "etp": dims.etp, "order": dims.order, "dispatcher": self.strategy.dispatcher,
        }

    def model_state_dict(self) -> dict[str, Any]:
        """The LightningModule's state dict (global keys and shapes)."""
        return self.strategy.lightning_module.state_dict()

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """``{"state": ..., "param_groups": ...}`` keyed by parameter name."""
        optimizer = _raw(optimizer)
        model = self.strategy.lightning_module
        return {
            "state": optimizer_state_dict(model, optimizer, self._converter),
            "param_groups": optimizer_param_groups(model, optimizer),
        }

    def save(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Write ``checkpoint`` (Lightning's dict) to ``path``; collective over all ranks."""
        strategy = self.strategy
        if not self.sharded:
            self._save_consolidated(checkpoint, path)
            return
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        param_groups = []
        for i, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{i}"] = optim_state["state"]
            param_groups.append(optim_state["param_groups"])
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(path, overwrite=True))
        if strategy.global_rank == 0:
            checkpoint[_LAYOUT_KEY] = {"layout": self._layout(), "optimizer_param_groups": param_groups}
            torch.save(checkpoint, path / _METADATA_FILENAME)
        strategy.barrier()

    def _save_consolidated(self, checkpoint: dict[str, Any], path: Path) -> None:
        state = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in checkpoint.pop("state_dict").items()
        }
        checkpoint.pop("optimizer_states", None)
        if self.strategy.global_rank == 0:
            if path.is_dir():
                shutil.rmtree(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            checkpoint["state_dict"] = state
            checkpoint[_LAYOUT_KEY] = {"layout": self._layout(), "optimizer_param_groups": []}
            torch.save(checkpoint, path)
        self.strategy.barrier()

    def load(self, path: Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load ``path`` into the live model and optimizers; return Lightning's remaining metadata.

        ``weights_only=False`` (trusted checkpoints only) lets the metadata hold arbitrary objects,
        e.g. hyperparameters that are dataclasses; DCP's shards are always read with the allowlist.
        """
        model = self.strategy.lightning_module
        strict = getattr(model, "strict_loading", True)
        safe = weights_only is not False
        if path.is_file():
            checkpoint = torch.load(path, map_location="cpu", weights_only=safe)
            model.load_state_dict(checkpoint.pop("state_dict"), strict=strict)
            checkpoint.pop(_LAYOUT_KEY, None)
            if self.strategy.optimizers:
                rank_zero_warn(
                    f"{path} is a consolidated checkpoint: it holds the model weights only, so the optimizer "
                    "starts from a fresh state. Resume from a sharded checkpoint to keep it."
                )
            return checkpoint
        if not (path / _METADATA_FILENAME).is_file():
            raise FileNotFoundError(f"{path} is not a sharded lightning_moe checkpoint (no {_METADATA_FILENAME}).")
        meta = torch.load(path / _METADATA_FILENAME, map_location="cpu", weights_only=safe)
        saved = meta.pop(_LAYOUT_KEY, {})
        self._report_layout_change(saved.get("layout"))
        optimizers = [_raw(o) for o in self.strategy.optimizers]
        templates: dict[str, Any] = {"state_dict": model.state_dict()}
        for i, optimizer in enumerate(optimizers):
            init_optimizer_state(optimizer)
            templates[f"optimizer_{i}"] = optimizer_state_dict(model, optimizer, self._converter)
        dcp.load(templates, storage_reader=SafeFileSystemReader(path))
        model.load_state_dict(templates["state_dict"], strict=strict)
        saved_groups = saved.get("optimizer_param_groups") or []
        for i, optimizer in enumerate(optimizers):
            groups = saved_groups[i] if i < len(saved_groups) else None
            load_optimizer_state_dict(model, optimizer, templates[f"optimizer_{i}"], groups, self._converter)
        return meta

    def _report_layout_change(self, saved: dict[str, Any] | None) -> None:
        if not saved:
            return
        current = self._layout()
        changed = {k: (saved.get(k), current[k]) for k in current if saved.get(k) != current[k]}
        if changed:
            diff = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items())
            rank_zero_info(f"Resharding the checkpoint to the current layout ({diff}).")
