"""How `MoEStrategy` writes and reads checkpoints.

Sharded (default): a directory in Lightning's sharded layout, so ``ModelCheckpoint``,
``ckpt_path=`` and top-k pruning work unchanged:

* ``torch.distributed.checkpoint`` shards (written by every rank) holding only tensors:
  ``state_dict`` (the model, expert tensors as global-shape DTensors) and ``optimizer_<i>``
  (per-parameter state keyed by parameter name);
* ``meta.pt`` (rank 0): everything else Lightning saves (loops, callbacks, hyperparameters), and
  under ``"lightning_moe"`` the optimizers' param groups, the saving layout, the save id and the
  size and SHA-256 of every file of the save (:mod:`lightning_moe.parallel.checkpoint_integrity`).

Saves are atomic (:mod:`lightning_moe.parallel.checkpoint_files`): each is written into a hidden
sibling folder and renamed into place by rank 0 once every rank finished, so a crash leaves the
previous complete checkpoint (or the new complete one), never a mix, and a reused name keeps no
shards of an earlier layout.

Loading checks completeness first (``meta.pt``, ``.metadata`` of the same save, every shard it
names, sizes), then the digests (unless ``verify_checkpoints=False``), every error naming the file
and raised on every rank; then it builds the templates at the *current* layout and lets DCP fill
them, so a checkpoint written at one expert-parallel size resumes at another. ``meta.pt`` is read
with ``weights_only=True`` and DCP's files through
:func:`~lightning_moe.parallel.checkpoint.load_sharded`: nothing in a checkpoint can run code.

With ``save_distributed_checkpoint=False`` rank 0 writes one ``torch.save`` file of global tensors
(model weights only; optimizer states are not consolidated), e.g. for inference; it is replaced
atomically too.
"""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.tensor import DTensor

from lightning_moe.parallel.checkpoint import (
    distribute_full_tensors,
    init_optimizer_state,
    load_optimizer_state_dict,
    load_sharded,
    optimizer_param_groups,
    optimizer_state_dict,
)
from lightning_moe.parallel.checkpoint_files import (
    describe_write_error,
    find_os_error,
    interrupted_replacement,
    leftovers,
    prepare_partial,
    probe_writable,
    remove_path,
    replace,
    write_torch_file,
)
from lightning_moe.parallel.checkpoint_integrity import (
    DCP_METADATA,
    LAYOUT_KEY,
    META_FILE,
    gather,
    has_digests,
    record_files,
    verify_digests,
)
from lightning_moe.parallel.checkpoint_security import load_torch_file, read_sharded_metadata
from lightning_moe.parallel.expert_parallel import ExpertStateConverter

if TYPE_CHECKING:
    from lightning_moe.strategies.moe_strategy import MoEStrategy

__all__ = ["MoECheckpointing"]

_T = TypeVar("_T")


def _raw(optimizer):
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _portable(err: BaseException) -> BaseException:
    # Rank 0's error travels to the other ranks pickled; keep its type when that works.
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


class _RecordingWriter(dcp.FileSystemWriter):
    """``FileSystemWriter`` that remembers the files this rank wrote, stamps our save id into
    ``.metadata`` and turns a failed write into an ``OSError`` that keeps its errno across ranks."""

    def __init__(self, path: Path, save_id: str) -> None:
        super().__init__(path, overwrite=True)
        self.lightning_moe_save_id = save_id
        self.written: set[str] = set()

    def storage_meta(self) -> StorageMeta:
        """DCP's storage metadata with the save id that ``meta.pt`` records too."""
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.lightning_moe_save_id)

    def write_data(self, plan, planner):
        """DCP's write; records the written files' names."""
        try:
            future = super().write_data(plan, planner)
            results = future.wait()
        except Exception as err:
            # torch.save's "unexpected pos" hides the file object's OSError in its context, which
            # does not survive DCP sending this rank's exception to the others.
            os_error = find_os_error(err)
            if os_error is None:
                raise
            raise OSError(os_error.errno, os_error.strerror, os_error.filename) from err
        self.written.update(result.storage_data.relative_path for result in results)
        return future


class MoECheckpointing:
    """The checkpoint half of `MoEStrategy` (see the module docstring).

    Args:
        strategy: the strategy whose model, optimizers and ranks are saved and loaded.
        save_distributed_checkpoint: sharded directories (True) or one consolidated file.
        verify_checkpoints: hash every file at save and verify the digests at load (default).
            False skips both, for very large checkpoints; completeness and sizes are still checked.
    """

    def __init__(self, strategy: MoEStrategy, save_distributed_checkpoint: bool = True,
                 verify_checkpoints: bool = True) -> None:
        self.strategy = strategy
        self.sharded = save_distributed_checkpoint
        self.verify = verify_checkpoints

    @property
    def _converter(self) -> ExpertStateConverter:
        return ExpertStateConverter(self.strategy.parallel_context)

    def _layout(self) -> dict[str, Any]:
        dims = self.strategy.parallel_context.dims
        return {
            "world_size": dims.world_size, "tp": dims.tp, "cp": dims.cp, "pp": dims.pp, "ep": dims.ep,
            "etp": dims.etp, "order": dims.order, "dispatcher": self.strategy.dispatcher,
            "sharding_strategy": self.strategy.sharding_strategy,
        }

    def _on_rank_zero(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on rank 0 and broadcast its result, or raise its error on every rank."""
        result, error = None, None
        if self.strategy.global_rank == 0:
            try:
                result = fn()
            except Exception as err:
                error = err
        result, remote_error = self.strategy.broadcast((result, None if error is None else _portable(error)))
        if error is not None:
            raise error
        if remote_error is not None:
            raise remote_error
        return result

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

    # -- save -----------------------------------------------------------------------------------

    def save(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Write ``checkpoint`` (Lightning's dict) to ``path`` atomically; collective over all ranks.

        Errors (a full disk, permissions) are raised on every rank, naming ``path`` and the errno.
        """
        save_id = self._on_rank_zero(lambda: uuid.uuid4().hex)
        if not self.sharded:
            self._save_consolidated(checkpoint, path, save_id)
            return
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        param_groups = []
        for i, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{i}"] = optim_state["state"]
            param_groups.append(optim_state["param_groups"])
        partial = self._on_rank_zero(lambda: self._guard_write(path, lambda: prepare_partial(path, save_id, True)))
        writer = _RecordingWriter(partial, save_id)
        try:
            dcp.save(tensors, storage_writer=writer)
        except (Exception, CheckpointException) as err:  # DCP raises it on every rank alike
            raise describe_write_error(path, err) from err
        try:  # each rank hashes what it wrote, in parallel
            local: tuple[dict | None, BaseException | None] = (record_files(partial, writer.written, self.verify), None)
        except Exception as err:  # sent to rank 0 instead of raised here: the others would wait in gather
            local = (None, _portable(describe_write_error(path, err)))
        gathered = gather(local)

        def publish() -> None:
            errors = [error for _, error in gathered if error is not None]
            if errors:
                raise errors[0]
            files = {name: record for records, _ in gathered for name, record in (records or {}).items()}
            files.update(record_files(partial, [DCP_METADATA], self.verify))
            checkpoint[LAYOUT_KEY] = {
                "layout": self._layout(), "optimizer_param_groups": param_groups, "save_id": save_id, "files": files,
            }
            self._guard_write(path, lambda: write_torch_file(checkpoint, partial / META_FILE))
            self._guard_write(path, lambda: replace(partial, path, save_id))

        self._on_rank_zero(publish)

    @staticmethod
    def _guard_write(path: Path, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except OSError as err:
            raise describe_write_error(path, err) from err
        except RuntimeError as err:  # torch.save's "unexpected pos": the OSError is in its context
            if find_os_error(err) is None:
                raise
            raise describe_write_error(path, err) from err

    def _save_consolidated(self, checkpoint: dict[str, Any], path: Path, save_id: str) -> None:
        state = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in checkpoint.pop("state_dict").items()
        }
        checkpoint.pop("optimizer_states", None)

        def write() -> None:
            partial = self._guard_write(path, lambda: prepare_partial(path, save_id, False))
            checkpoint["state_dict"] = state
            checkpoint[LAYOUT_KEY] = {"layout": self._layout(), "optimizer_param_groups": [], "save_id": save_id}
            self._guard_write(path, lambda: write_torch_file(checkpoint, partial))
            self._guard_write(path, lambda: replace(partial, path, save_id))

        self._on_rank_zero(write)

    def remove(self, path: Path) -> None:
        """Delete the checkpoint ``path`` and what interrupted saves of it left; on rank 0 only,
        like Lightning's ``Strategy.remove_checkpoint``."""
        for victim in [path, *leftovers(path)]:
            remove_path(victim)

    def check_writable(self, dirpath: str | Path) -> None:
        """Raise on every rank, naming ``dirpath`` and the OS error, unless rank 0 can create (if
        needed) the directory and create and remove a file in it. Collective; remote (fsspec)
        paths are not probed."""
        if not _is_local_file_protocol(str(dirpath)):
            return
        error = self._on_rank_zero(lambda: probe_writable(Path(dirpath)))
        if error is not None:
            raise error

    # -- load -----------------------------------------------------------------------------------

    def _resolve(self, path: Path) -> Path:
        if path.exists():
            return path
        previous = interrupted_replacement(path)
        if previous is None:
            raise FileNotFoundError(2, f"Checkpoint {path} does not exist")
        rank_zero_warn(
            f"{path} is missing: a save was interrupted while replacing it. Loading the previous complete "
            f"checkpoint {previous} instead (the next save of {path.name} removes it)."
        )
        return previous

    def _check_sharded(self, path: Path, weights_only: bool) -> tuple[dict[str, Any], Any]:
        # Completeness, on rank 0: every file there, of this save, long enough.
        for name in (META_FILE, DCP_METADATA):
            if not (path / name).is_file():
                raise FileNotFoundError(
                    2, f"{path} is not a complete sharded lightning_moe checkpoint: no {name} (an interrupted "
                    "save or copy, or not a checkpoint)",
                )
        return read_sharded_metadata(path, weights_only)

    def load(self, path: Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load ``path`` into the live model and optimizers; return Lightning's remaining metadata.

        ``weights_only=False`` (trusted checkpoints only) lets the metadata hold arbitrary objects,
        e.g. hyperparameters that are dataclasses; DCP's shards are always read with the allowlist.
        """
        model = self.strategy.lightning_module
        strict = getattr(model, "strict_loading", True)
        safe = weights_only is not False
        path = self._on_rank_zero(lambda: self._resolve(path))
        if path.is_file():
            checkpoint = load_torch_file(path, safe)
            model.load_state_dict(distribute_full_tensors(model, checkpoint.pop("state_dict")), strict=strict)
            checkpoint.pop(LAYOUT_KEY, None)
            if self.strategy.optimizers:
                rank_zero_warn(
                    f"{path} is a consolidated checkpoint: it holds the model weights only, so the optimizer "
                    "starts from a fresh state. Resume from a sharded checkpoint to keep it."
                )
            return checkpoint
        checked: dict[str, Any] = {"meta": None, "metadata": None}  # rank 0 reuses what it read

        def check() -> None:
            checked["meta"], checked["metadata"] = self._check_sharded(path, safe)

        self._on_rank_zero(check)
        meta = checked["meta"] if checked["meta"] is not None else load_torch_file(path / META_FILE, safe)
        saved = meta.pop(LAYOUT_KEY, {})
        if self.verify:
            if has_digests(saved.get("files")):
                verify_digests(path, saved["files"])  # every rank its share, raised on every rank
            else:
                rank_zero_warn(
                    f"{path} has no checksums (written by an earlier lightning_moe, or with "
                    "verify_checkpoints=False): its files cannot be verified before loading."
                )
        self._report_layout_change(saved.get("layout"))
        optimizers = [_raw(o) for o in self.strategy.optimizers]
        templates: dict[str, Any] = {"state_dict": model.state_dict()}
        for i, optimizer in enumerate(optimizers):
            init_optimizer_state(optimizer)
            templates[f"optimizer_{i}"] = optimizer_state_dict(model, optimizer, self._converter)
        load_sharded(templates, path, metadata=checked["metadata"])
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
