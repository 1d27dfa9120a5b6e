"""Every private torch and Lightning API the product code relies on, one small function each.

Private APIs change without deprecation, so each use lives here, named for what it does, with the
version it was checked against (torch 2.13, Lightning 2.6): an upgrade that moves one breaks here,
in one place. Lightning and ``torch.distributed`` are imported inside the functions that need them,
so the core subpackages (single-device ``layers/`` and ``memory/`` included) import this module
without Lightning. The planner's private torch classes (fake tensors, ``ModTracker``...) are
re-exported as they are, imported on first use (``_LAZY_NAMES``).

Deliberately not routed: ``nn.Module``'s ``_parameters``, ``_buffers``, ``_modules`` and
``_non_persistent_buffers_set`` (assigned in a few places to swap tensors or children in place) and
a LightningModule subclass reading its own ``_trainer``: every major library relies on them, and
wrapping a dict lookup would hide what the code does without making an upgrade safer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree

__all__ = [
    "clear_sharding_caches", "compute_local_shape_and_global_offset", "current_graph_task_id",
    "default_process_group_backend", "default_store", "device_constructors", "dtensor_local",
    "dtensor_op_dispatcher", "flash_attention_cpu", "flash_attention_cpu_backward", "flash_attention_cuda",
    "flash_attention_cuda_backward", "format_summary_table", "fsdp_finish_root_backward", "fsdp_lazy_init",
    "fsdp_param_groups", "fsdp_root_states", "fsdp_shared_states", "fsdp_state", "fsdp_storage_modules",
    "has_scaled_grouped_mm", "host_read_op", "init_dist_connection", "is_local_path", "is_runtime_schedule",
    "is_strided_shard", "keep_forward_actions", "layout_lookup_global", "logs_this_step", "onednn_linear",
    "optimizers_to_device", "patch_tensor_meta_propagation", "register_fake_backend", "resolve_process_group",
    "scaled_grouped_mm", "scaled_mm", "script_object_kind", "set_default_group_timeout", "set_element",
    "set_num_threads_if_needed", "set_schedule_microbatches", "set_skip_backward", "shard_shape_and_offset_at", "start_child_ranks",
    "storage_alignment", "storage_identity", "storage_type_name", "subprocess_script_launcher",
    "sync_ddp_if_available", "tensor_rebuild_function", "tensor_version", "top_saved_tensors_hooks",
    "torch_zip_writer", "trainer_results", "tree_flatten", "tree_map_only", "typed_storage_parts",
    "unbox_process_group", "view_base",
]


# --- torch -------------------------------------------------------------------------------------


def fsdp_state(unit: torch.nn.Module) -> Any:
    """The FSDP2 state of a ``fully_shard`` unit: ``unit._get_fsdp_state()`` (torch 2.13; the
    same private call ``torch.distributed.pipelining.stage`` makes)."""
    return unit._get_fsdp_state()


def fsdp_param_groups(state: Any) -> list:
    """The parameter groups of an FSDP2 state: torch >= 2.13 keeps a list ``_fsdp_param_groups``
    (one unit may hold several); earlier versions one ``_fsdp_param_group`` or None."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def fsdp_lazy_init(state: Any) -> None:
    """Run FSDP2's lazy initialisation of a root state now (``_lazy_init``, torch 2.13; a no-op
    once it ran)."""
    state._lazy_init()


def fsdp_shared_states(state: Any) -> list:
    """Every FSDP2 state sharing ``state``'s context: a root's and its units' (``_state_ctx.all_states``,
    torch 2.13)."""
    return list(state._state_ctx.all_states)


def fsdp_root_states(units: Iterable[torch.nn.Module]) -> list:
    """The root FSDP2 states of ``units``: a root and its units share one ``_state_ctx`` (torch
    2.13, from the first forward on), whose ``all_states`` the roots (``_is_root``) are among."""
    contexts = {id(state._state_ctx): state._state_ctx for state in map(fsdp_state, units)}
    return [state for context in contexts.values() for state in context.all_states if state._is_root]


def fsdp_finish_root_backward(root_state: Any) -> None:
    """Run FSDP2's end-of-backward callback of a root state (``_root_post_backward_final_callback``,
    torch 2.13): waits for the reductions and resets the units for the next step."""
    root_state._root_post_backward_final_callback()


def dtensor_op_dispatcher() -> Any:
    """DTensor's operator dispatcher (``DTensor._op_dispatcher``, torch 2.13): holds the
    implicit-replication flag and the sharding propagator with its caches."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher


def compute_local_shape_and_global_offset(global_shape, mesh, placements) -> tuple:
    """``(local shape, global offset)`` of this rank's piece of a DTensor of ``global_shape``
    (``torch.distributed.tensor._utils``, torch 2.13)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(global_shape, mesh, placements)


def tree_flatten(tree: Any) -> tuple[list, Any]:
    """``(leaves, spec)`` of a nested container (``torch.utils._pytree.tree_flatten``, torch 2.13)."""
    return _pytree.tree_flatten(tree)


def tree_map_only(kind: type | tuple[type, ...], fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to its leaves of type ``kind`` (``torch.utils._pytree``, torch 2.13)."""
    return _pytree.tree_map_only(kind, fn, tree)


def device_constructors() -> set:
    """The torch functions that take a ``device=`` and create a tensor
    (``torch.utils._device._device_constructors``, torch 2.13)."""
    from torch.utils._device import _device_constructors

    return _device_constructors()


def set_default_group_timeout(timeout: Any) -> None:
    """Set the timeout of the default process group's collectives after it was created
    (``torch.distributed.distributed_c10d._set_pg_timeout``, torch 2.13)."""
    import torch.distributed as dist

    dist.distributed_c10d._set_pg_timeout(timeout)


def default_store() -> Any:
    """The key-value store of the default process group; raises when there is none
    (``torch.distributed.distributed_c10d._get_default_store``, torch 2.13)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def register_fake_backend() -> type:
    """Register torch's ``"fake"`` process-group backend (every collective answers at once, nothing
    is sent) and return its ``FakeStore`` class (``torch.testing._internal.distributed.fake_pg``,
    torch 2.13)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore


def is_runtime_schedule(schedule: Any) -> bool:
    """Whether a pipeline schedule is a multi-stage one run from an action plan
    (``torch.distributed.pipelining.schedules._PipelineScheduleRuntime``, torch 2.13)."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    return isinstance(schedule, _PipelineScheduleRuntime)


def set_schedule_microbatches(schedule: Any, n_microbatches: int, warmup: int | None = None) -> None:
    """Make a single-stage pipeline schedule run ``n_microbatches`` per step, and (``Schedule1F1B``)
    ``warmup`` forwards before its first backward (``torch.distributed.pipelining.schedules``'
    ``_n_microbatches``; ``Schedule1F1B`` warms up ``min(_n_microbatches, _num_stages - stage_index)``,
    torch 2.13). Before the schedule's first step, which sizes the stage's receive buffers; after
    it, between steps, to more micro-batches only: the stage gets receive buffers for the new ones
    (``PipelineStage``'s ``args_recv_info`` and ``grad_recv_info``, one entry per micro-batch, made
    by ``_setup_forward_recv_info`` and ``_setup_backward_recv_info`` once
    ``_stage_forward_initialized`` / ``_stage_backward_initialized`` are set). The buffers it has
    stay: the schedule's last step still holds some of them, so new ones in their place would be
    held twice."""
    stage = schedule._stage
    made = len(stage.args_recv_info) if getattr(schedule, "_stage_forward_initialized", False) else 0
    if n_microbatches < made:
        raise ValueError(f"a pipeline stage made for {made} micro-batches cannot run {n_microbatches}: only more.")
    schedule._n_microbatches = n_microbatches
    if warmup is not None:
        schedule._num_stages = stage.stage_index + warmup
    if made:
        kept = dict(stage.args_recv_info)
        stage._setup_forward_recv_info(n_microbatches, schedule._has_backward)
        stage.args_recv_info.update(kept)
    if made and getattr(schedule, "_stage_backward_initialized", False):
        kept = dict(stage.grad_recv_info)
        stage._setup_backward_recv_info(n_microbatches)
        stage.grad_recv_info.update(kept)


def keep_forward_actions(schedule: Any) -> None:
    """Keep only the forward actions of a multi-stage schedule's plan, its communication re-derived
    (``torch.distributed.pipelining.schedules``' ``_add_unshard_reshard``, ``_add_send_recv``,
    ``_ComputationType``, ``_num_stages``, torch 2.13).

    ``eval()`` of the V-shaped ZBV schedule in torch 2.13 still runs its backward actions and
    fails ("can't steal_bwd_input if this stage doesn't have backward"). The forward actions in
    their planned order stay deadlock-free: a forward depends only on earlier forwards. Lowered
    as ``_prepare_schedule_with_comms`` does, minus its check that every micro-batch has a backward.
    """
    from torch.distributed.pipelining.schedules import _add_send_recv, _add_unshard_reshard, _ComputationType

    order = {
        rank: _add_unshard_reshard(
            [a for a in actions if a is not None and a.computation_type == _ComputationType.FORWARD]
        )
        for rank, actions in schedule.pipeline_order.items()
    }
    schedule.pipeline_order_with_comms = _add_send_recv(
        order, stage_to_rank=lambda s: schedule.stage_index_to_group_rank[s], num_stages=schedule._num_stages
    )


def shard_shape_and_offset_at(global_shape, mesh_shape, coordinate, placements) -> tuple:
    """``(local shape, global offset)`` of the DTensor piece at mesh ``coordinate`` of a mesh of
    ``mesh_shape``, any rank's, not only this one's
    (``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``, torch 2.13)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    return _compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate, placements)


def set_element(root: Any, path: Any, value: Any) -> None:
    """Set the value at ``path`` (a DCP object path) of a nested state dict, creating the containers
    on the way (``torch.distributed.checkpoint._traverse.set_element``, torch 2.13)."""
    from torch.distributed.checkpoint._traverse import set_element as _set_element

    _set_element(root, path, value)


def layout_lookup_global() -> tuple[tuple[str, str], Callable[[str], Any]]:
    """``((module, name), function)`` of the global DCP's pickled metadata calls to turn a layout's
    string into a ``torch.layout`` (``torch.serialization._get_layout``, torch 2.13)."""
    return ("torch.serialization", "_get_layout"), torch.serialization._get_layout


def tensor_rebuild_function() -> Callable[..., Tensor]:
    """The function ``torch.save`` pickles a plain CPU tensor as a call of, with arguments
    ``(storage, offset, shape, stride, requires_grad, hooks)`` (``torch._utils._rebuild_tensor_v2``,
    torch 2.13)."""
    return torch._utils._rebuild_tensor_v2


def storage_type_name(dtype: torch.dtype) -> str:
    """The name of the legacy typed-storage class ``torch.save`` pickles for ``dtype``, e.g.
    ``"FloatStorage"`` (``torch.storage._dtype_to_storage_type_map``, torch 2.13)."""
    return torch.storage._dtype_to_storage_type_map()[dtype]


def torch_zip_writer(file: Any) -> Any:
    """The zip-archive writer ``torch.save`` writes its records with, on an open binary ``file``
    (``torch.serialization._open_zipfile_writer(file).file_like``, a ``PyTorchFileWriter``, torch 2.13)."""
    return torch.serialization._open_zipfile_writer(file).file_like


def storage_alignment() -> int:
    """The alignment in bytes of the storage records in a ``torch.save`` archive
    (``torch.serialization._get_storage_alignment``, torch 2.13)."""
    return torch.serialization._get_storage_alignment()


def typed_storage_parts(typed: Any) -> tuple[Any, str, int]:
    """``(untyped storage, legacy storage class name, number of elements)`` of a ``TypedStorage``, the
    parts ``torch.save`` pickles it as (``_untyped_storage``, ``_pickle_storage_type``, ``_size``,
    torch 2.13)."""
    return typed._untyped_storage, typed._pickle_storage_type(), typed._size()


def storage_identity(storage: Any) -> int:
    """A key equal for the handles of one storage while it lives (``UntypedStorage._cdata``, the C
    pointer ``torch.save`` de-duplicates storages by, torch 2.13)."""
    return storage._cdata


def scaled_mm(*args: Any, **kwargs: Any) -> Tensor:
    """PyTorch's scaled FP8 GEMM (``torch._scaled_mm``, torch 2.13: ``(a, b, scale_a=, scale_b=,
    out_dtype=, use_fast_accum=)``); looked up at each call, so a patched ``torch._scaled_mm`` is used."""
    return torch._scaled_mm(*args, **kwargs)


def has_scaled_grouped_mm() -> bool:
    """Whether this torch has the grouped scaled FP8 GEMM (``torch._scaled_grouped_mm``, torch 2.13)."""
    return hasattr(torch, "_scaled_grouped_mm")


def scaled_grouped_mm(*args: Any, **kwargs: Any) -> Tensor:
    """PyTorch's grouped scaled FP8 GEMM (``torch._scaled_grouped_mm``, torch 2.13, CUDA sm90+:
    ``(a, b, scale_a, scale_b, offs=, out_dtype=, use_fast_accum=)``)."""
    return torch._scaled_grouped_mm(*args, **kwargs)


def flash_attention_cpu(*args: Any, **kwargs: Any) -> tuple:
    """PyTorch's fused CPU attention forward, ``(out, lse)``
    (``aten._scaled_dot_product_flash_attention_for_cpu``, torch 2.13)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args, **kwargs)


def flash_attention_cpu_backward(*args: Any, **kwargs: Any) -> tuple:
    """PyTorch's fused CPU attention backward, ``(dq, dk, dv)``
    (``aten._scaled_dot_product_flash_attention_for_cpu_backward``, torch 2.13)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*args, **kwargs)


def flash_attention_cuda(*args: Any, **kwargs: Any) -> tuple:
    """PyTorch's CUDA flash-attention forward, ``(out, lse, cum_q, cum_k, max_q, max_k, rng_state,
    unused, debug_mask)`` (``aten._scaled_dot_product_flash_attention``, torch 2.13)."""
    return torch.ops.aten._scaled_dot_product_flash_attention(*args, **kwargs)


def flash_attention_cuda_backward(*args: Any, **kwargs: Any) -> tuple:
    """PyTorch's CUDA flash-attention backward, ``(dq, dk, dv)``
    (``aten._scaled_dot_product_flash_attention_backward``, torch 2.13)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(*args, **kwargs)


def is_strided_shard(placement: Any) -> bool:
    """Whether a DTensor placement is a strided shard, the placement FSDP2 gives a dimension that
    tensor parallelism shards too (``torch.distributed.tensor.placement_types._StridedShard``, a
    ``Shard`` subclass with ``split_factor``, torch 2.13)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


def onednn_linear(a: Tensor, w: Tensor) -> Tensor:
    """``a @ w.T`` through oneDNN's fp32 linear, ``torch.ops.mkldnn._linear_pointwise`` (torch 2.13;
    the op ``torch.compile`` lowers CPU linears to). Callers check it computes correctly first."""
    return torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")


def current_graph_task_id() -> int:
    """Id of the autograd backward call running now: ``torch._C._current_graph_task_id()`` (torch
    2.13); -1 outside a backward or where torch lacks the query."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else -1


def top_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """The innermost active ``saved_tensors_hooks`` ``(pack, unpack)`` pair:
    ``torch._C._autograd._top_saved_tensors_default_hooks(False)`` (torch 2.13); None when none is
    active or torch lacks the query."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


def clear_sharding_caches(propagator: Any) -> None:
    """Empty DTensor's caches of op output layouts: the C++ fast path's
    (``torch._C._clear_DTensor_sharding_propagator_cache``) and ``propagator``'s Python ones
    (``propagate_op_sharding`` and ``_propagate_tensor_meta_cached``; torch 2.13)."""
    torch._C._clear_DTensor_sharding_propagator_cache()
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()


def patch_tensor_meta_propagation(wrap: Callable[[Callable], Callable]) -> Any:
    """A context manager replacing ``ShardingPropagator._propagate_tensor_meta_non_cached`` (the
    call in which DTensor runs an op on global-shape fake tensors to learn its output's shape,
    torch 2.13) by ``wrap(original)`` while it is entered."""
    from unittest import mock

    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached
    return mock.patch.object(ShardingPropagator, "_propagate_tensor_meta_non_cached", wrap(original))


def script_object_kind(value: Any) -> str:
    """The TorchScript class name of a ``torch.ScriptObject`` (``value._type()``, torch 2.13), e.g.
    ``"__torch__.torch.classes.c10d.ProcessGroup"``; "" for anything else."""
    return str(value._type()) if isinstance(value, torch.ScriptObject) else ""


def unbox_process_group(value: Any) -> Any:
    """The ``ProcessGroup`` behind a ``ProcessGroup`` script object a dispatched collective
    receives (``torch._C._distributed_c10d.ProcessGroup.unbox``, torch 2.13)."""
    return torch._C._distributed_c10d.ProcessGroup.unbox(value)


def host_read_op() -> Any:
    """The aten op a tensor's ``.item()`` / ``bool()`` dispatches to (``aten._local_scalar_dense``):
    the one host read a dispatch mode can see (torch 2.13)."""
    return torch.ops.aten._local_scalar_dense.default


def tensor_version(tensor: Tensor) -> int:
    """The in-place version counter of ``tensor`` (``tensor._version``, torch 2.13: the counter
    autograd checks saved tensors against; every in-place op bumps it)."""
    return tensor._version


def view_base(tensor: Tensor) -> Tensor | None:
    """The tensor ``tensor`` is a view of (``tensor._base``, torch 2.13), or None for a non-view."""
    return tensor._base


def dtensor_local(tensor: Tensor) -> Tensor:
    """The local shard behind a DTensor without autograd's view (``DTensor._local_tensor``, torch
    2.13); any other tensor as it is."""
    return getattr(tensor, "_local_tensor", tensor)


def resolve_process_group(name: str) -> Any:
    """The process group a functional collective names by its string
    (``torch.distributed.distributed_c10d._resolve_process_group``, torch 2.13)."""
    import torch.distributed as dist

    return dist.distributed_c10d._resolve_process_group(name)


def fsdp_storage_modules() -> tuple:
    """The FSDP2 modules that look up ``alloc_storage``/``free_storage`` (the unsharded parameters'
    ``storage.resize_``) by name, so that a patch of those names there is seen
    (``torch.distributed.fsdp._fully_shard._fsdp_param`` and ``._fsdp_param_group``, torch 2.13)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    return _fsdp_param, _fsdp_param_group


_LAZY_NAMES: dict[str, tuple[str, str]] = {
    "FakeTensor": ("torch._subclasses.fake_tensor", "FakeTensor"),
    "FakeTensorMode": ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    "unset_fake_temporarily": ("torch._subclasses.fake_tensor", "unset_fake_temporarily"),
    "ModTracker": ("torch.distributed._tools.mod_tracker", "ModTracker"),
    "ShardingPropagator": ("torch.distributed.tensor._sharding_prop", "ShardingPropagator"),
    "TorchDispatchMode": ("torch.utils._python_dispatch", "TorchDispatchMode"),
    "is_traceable_wrapper_subclass": ("torch.utils._python_dispatch", "is_traceable_wrapper_subclass"),
}
"""Classes and functions of private torch modules the planner uses as they are (subclassed, patched,
tested with ``isinstance``), checked against torch 2.13: ``from lightning_moe.compat import
FakeTensor`` imports the module on first use, so importing compat stays light."""


def __getattr__(name: str) -> Any:
    """The names of ``_LAZY_NAMES``, imported from their torch 2.13 module when first asked for."""
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY_NAMES[name]
    return getattr(importlib.import_module(module), attribute)


# --- Lightning ---------------------------------------------------------------------------------


def trainer_results(trainer: Any) -> Any:
    """The running loop's logged-metric collection (``trainer._results``, a ``_ResultCollection``,
    Lightning 2.6): keys ``<hook>.<name>``, each entry with ``reset()``."""
    return trainer._results


def logs_this_step(trainer: Any) -> bool:
    """Whether Lightning writes step metrics to the loggers after this batch (its logger
    connector's ``should_update_logs``, Lightning 2.6), or ``fast_dev_run`` is on."""
    return bool(trainer._logger_connector.should_update_logs or trainer.fast_dev_run)


def set_skip_backward(trainer: Any, skip: bool) -> None:
    """Switch Lightning's own backward (and ``zero_grad``) in the fit loop off or on
    (``trainer.fit_loop._skip_backward``, Lightning 2.6; ``StochasticWeightAveraging`` uses it)."""
    trainer.fit_loop._skip_backward = skip


def default_process_group_backend(device: torch.device) -> str:
    """Lightning's default process-group backend for ``device`` (nccl on CUDA, gloo otherwise;
    ``lightning.fabric.utilities.distributed._get_default_process_group_backend_for_device``, Lightning 2.6)."""
    from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device

    return _get_default_process_group_backend_for_device(device)


def optimizers_to_device(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> None:
    """Move the optimizers' state to ``device`` (``lightning.fabric.utilities.optimizer._optimizers_to_device``,
    Lightning 2.6)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def sync_ddp_if_available(tensor: Tensor, group: Any = None, reduce_op: Any = None) -> Tensor:
    """Lightning's all-reduce of ``tensor`` when a process group is up, ``tensor`` otherwise
    (``lightning.fabric.utilities.distributed._sync_ddp_if_available``, Lightning 2.6)."""
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available

    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def set_num_threads_if_needed(num_processes: int) -> None:
    """Lightning's default of ``torch`` CPU threads per process when ``OMP_NUM_THREADS`` is unset
    (``lightning.fabric.utilities.distributed._set_num_threads_if_needed``, Lightning 2.6)."""
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

    _set_num_threads_if_needed(num_processes=num_processes)


def init_dist_connection(environment: Any, backend: str, **kwargs: Any) -> None:
    """Lightning's ``init_process_group`` from a cluster environment
    (``lightning.fabric.utilities.distributed._init_dist_connection``, Lightning 2.6)."""
    from lightning.fabric.utilities.distributed import _init_dist_connection

    _init_dist_connection(environment, backend, **kwargs)


def format_summary_table(*args: Any, **kwargs: Any) -> str:
    """Lightning's model-summary table text
    (``lightning.pytorch.utilities.model_summary.model_summary._format_summary_table``, Lightning 2.6)."""
    from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

    return _format_summary_table(*args, **kwargs)


def subprocess_script_launcher() -> type:
    """Lightning's launcher that starts the other local ranks by re-running the script, the base class
    of the strategy's launcher (``lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher``,
    Lightning 2.6)."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    return _SubprocessScriptLauncher


def start_child_ranks(launcher: Any) -> None:
    """Start the other local ranks of a ``subprocess_script_launcher()`` launcher as re-runs of the script
    (its ``_call_children_scripts``, Lightning 2.6)."""
    launcher._call_children_scripts()


def is_local_path(path: str) -> bool:
    """Whether ``path`` is on the local file system, not a remote URL such as ``s3://``
    (``lightning.fabric.utilities.cloud_io._is_local_file_protocol``, Lightning 2.6)."""
    from lightning.fabric.utilities.cloud_io import _is_local_file_protocol

    return _is_local_file_protocol(path)
