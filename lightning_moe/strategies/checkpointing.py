"""How `MoEStrategy` writes and reads checkpoints.

Sharded (default): a directory in Lightning's sharded layout, so ``ModelCheckpoint``,
``ckpt_path=`` and top-k pruning work unchanged:

* ``torch.distributed.checkpoint`` shards (written by every rank) holding only tensors:
  ``state_dict`` (the model, expert tensors as global-shape DTensors) and ``optimizer_<i>``
  (per-parameter state keyed by parameter name);
* ``meta.pt`` (rank 0): everything else Lightning saves (loops, callbacks, hyperparameters), and
  under ``"lightning_moe"`` the optimizers' param groups, the saving layout, the save id and the
  size and SHA-256 of every file of the save (:mod:`lightning_moe.checkpoint.integrity`);
* ``meta.pt.json`` (rank 0): the size and SHA-256 of ``meta.pt`` itself.

Saves are atomic (:mod:`lightning_moe.checkpoint.files`): each is written into a hidden
sibling folder and renamed into place by rank 0 once every rank finished, so a crash leaves the
previous complete checkpoint (or the new complete one), never a mix, and a reused name keeps no
shards of an earlier layout.

Loading checks, on rank 0, ``meta.pt`` and then ``.metadata`` against their records before
unpickling either, completeness (``.metadata`` of the same save, every shard it names, sizes; every
file a regular file inside the folder, no links) and that ``.metadata``'s entries cover their
tensors and ask for no more bytes than the files hold; then every rank its share of the shards'
digests (unless ``verify_checkpoints=False``, which skips every digest but no other check), and
that the entries hold the model's and optimizer's keys with their global shapes and dtypes; every
error names the file and is raised on every rank. Then it builds the templates at the *current*
layout and lets DCP fill them, so a checkpoint written at one expert-parallel size resumes at
another. Path entries of the restored ``ModelCheckpoint`` states that point outside their folder
are dropped, and :meth:`MoECheckpointing.remove` deletes nothing outside the callbacks' folders
(:mod:`lightning_moe.strategies.checkpoint_paths`). ``meta.pt`` is read
with ``weights_only=True`` and DCP's files through
:func:`~lightning_moe.checkpoint.sharded.load_sharded`: nothing in a checkpoint can run code.

With ``save_distributed_checkpoint=False`` rank 0 writes one ``torch.save`` file of global tensors
(model weights only; optimizer states are not consolidated), e.g. for inference; it is replaced
atomically too. The tensors reach rank 0 one at a time and are written as they arrive
(:mod:`lightning_moe.checkpoint.consolidated`): rank 0 holds one full tensor and one received piece
at most, the other ranks nothing beyond their shards. Loading it, every rank maps the file
(``torch.load(mmap=True)``) and copies its own slices from the mapping, so no rank reads the
whole model into its memory.
"""

from __future__ import annotations

import io
import json
import pickle
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta

from lightning_moe.checkpoint.consolidated import write_consolidated
from lightning_moe.checkpoint.entries import check_entries, expected_entries
from lightning_moe.checkpoint.files import (
    describe_write_error,
    find_os_error,
    interrupted_replacement,
    leftovers,
    prepare_partial,
    probe_writable,
    removal_refusal,
    remove_path,
    replace,
    write_bytes_file,
)
from lightning_moe.checkpoint.integrity import (
    DCP_METADATA,
    LAYOUT_KEY,
    META_DIGEST_FILE,
    META_FILE,
    CheckpointIntegrityError,
    gather,
    has_digests,
    read_meta_digest,
    record_bytes,
    record_files,
    verify_digests,
)
from lightning_moe.checkpoint.legacy import adopt_legacy_fc1
from lightning_moe.checkpoint.security import load_torch_file, read_sharded_metadata
from lightning_moe.checkpoint.sharded import (
    distribute_full_tensors,
    init_optimizer_state,
    load_optimizer_state_dict,
    load_sharded,
    optimizer_param_groups,
    optimizer_state_dict,
)
from lightning_moe.compat import is_local_path
from lightning_moe.parallel.expert_parallel import ExpertStateConverter
from lightning_moe.strategies.checkpoint_paths import checkpoint_dirpaths, drop_outside_paths

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
        verify_checkpoints: hash every file at save and verify the digests at load (default;
            ``meta.pt`` and ``.metadata`` before they are unpickled). False skips every digest, for
            very large checkpoints; sizes, completeness, links and paths, and ``.metadata``'s
            entries against the files and the model are still checked.
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
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            data = buffer.getvalue()
            self._guard_write(path, lambda: write_bytes_file(data, partial / META_FILE))
            record = json.dumps(record_bytes(data, self.verify)).encode()
            self._guard_write(path, lambda: write_bytes_file(record, partial / META_DIGEST_FILE))
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
        state = checkpoint.pop("state_dict")
        checkpoint.pop("optimizer_states", None)
        checkpoint[LAYOUT_KEY] = {"layout": self._layout(), "optimizer_param_groups": [], "save_id": save_id}
        partial = self._on_rank_zero(lambda: self._guard_write(path, lambda: prepare_partial(path, save_id, False)))
        error: BaseException | None = None
        try:  # every rank: the tensors stream to rank 0 one at a time, rank 0 writes them as they come
            write_consolidated(state, checkpoint, partial, dst=0)
        except Exception as err:  # raised on rank 0 only, once every rank left the collectives
            error = err

        def publish() -> None:
            if error is not None:
                raise error
            replace(partial, path, save_id)

        self._on_rank_zero(lambda: self._guard_write(path, publish))

    def remove(self, path: Path, dirpaths: list[Path] | None = None) -> bool:
        """Delete the checkpoint ``path`` and what interrupted saves of it left; on rank 0 only,
        like Lightning's ``Strategy.remove_checkpoint``. Returns whether it did.

        ``dirpaths``: the checkpoint callbacks' folders (by default those of the strategy's
        trainer). A path outside them, or a folder holding files a save does not write, is left
        in place with a warning (see :func:`~lightning_moe.checkpoint.files.removal_refusal`).
        """
        if dirpaths is None and self.strategy is not None:
            dirpaths = checkpoint_dirpaths(self.strategy)
        refusal = removal_refusal(path, dirpaths)
        if refusal is not None:
            rank_zero_warn(f"Not removing the checkpoint {path}: {refusal}. Delete it yourself if it is one.")
            return False
        target = path.parent.resolve() / path.name
        for victim in [target, *leftovers(target)]:
            remove_path(victim)
        return True

    def check_writable(self, dirpath: str | Path) -> None:
        """Raise on every rank, naming ``dirpath`` and the OS error, unless rank 0 can create (if
        needed) the directory and create and remove a file in it. Collective; remote (fsspec)
        paths are not probed."""
        if not is_local_path(str(dirpath)):
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
        meta, metadata = read_sharded_metadata(path, weights_only, self.verify)
        saved = (meta.get(LAYOUT_KEY) if isinstance(meta, dict) else None) or {}
        if self.verify and has_digests(saved.get("files")) and read_meta_digest(path) is None:
            rank_zero_warn(f"{path} has no checksum of {META_FILE} (written by an earlier lightning_moe).")
        return meta, metadata

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
            checkpoint = load_torch_file(path, safe, mmap=True)  # each rank copies its slices from the mapping
            model.load_state_dict(distribute_full_tensors(model, checkpoint.pop("state_dict")), strict=strict)
            checkpoint.pop(LAYOUT_KEY, None)
            if self.strategy.optimizers:
                rank_zero_warn(
                    f"{path} is a consolidated checkpoint: it holds the model weights only, so the optimizer "
                    "starts from a fresh state. Resume from a sharded checkpoint to keep it."
                )
            return checkpoint
        checked: dict[str, Any] = {"meta": None}  # rank 0 reuses what it read

        def check() -> Any:
            checked["meta"], metadata = self._check_sharded(path, safe)
            return metadata

        # Every rank uses rank 0's checked metadata: none unpickles .metadata unchecked.
        metadata = self._on_rank_zero(check)
        meta = checked["meta"] if checked["meta"] is not None else load_torch_file(path / META_FILE, safe)
        saved = meta.pop(LAYOUT_KEY, {})
        drop_outside_paths(meta, path)
        if self.verify:
            if has_digests(saved.get("files")):
                # .metadata was verified before it was unpickled; every rank hashes its share of the rest.
                verify_digests(path, {n: r for n, r in saved["files"].items() if n != DCP_METADATA})
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
        whole_model = strict and self.strategy.parallel_context.dims.pp == 1  # under PP a rank holds its stages
        adopt_legacy_fc1(templates, metadata)  # an older checkpoint's gated fc1 [E, 2F, H]: templates of that shape
        try:
            check_entries(metadata, expected_entries(templates), path, "state_dict." if whole_model else None)
            problem = None
        except CheckpointIntegrityError as err:
            problem = str(err)
        problems = [p for p in gather(problem) if p]  # under PP the ranks' keys differ: raise on all alike
        if problems:
            raise CheckpointIntegrityError(problems[0])
        load_sharded(templates, path, metadata=metadata)
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
