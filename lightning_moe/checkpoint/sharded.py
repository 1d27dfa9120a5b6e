"""Sharded checkpoints of a parallelized model and its optimizer, with global, layout-free keys.

* Model: ``model.state_dict()`` already presents expert tensors as global-shape DTensors
  (``apply_expert_parallel``'s hooks); plain tensors are replicated and saved once by DCP.
* Optimizer: :func:`optimizer_state_dict` keys every state by parameter name (not by index) and
  turns each expert parameter's state tensors (``exp_avg``, ``momentum_buffer``, ...) into
  global DTensors the same way, so moments reshard with their weights. Only tensors go into the
  shards; the param-group hyperparameters are returned separately (:func:`optimizer_param_groups`)
  for the small metadata file.
* Loading goes through :func:`load_sharded` (:mod:`lightning_moe.checkpoint.security`):
  DCP's metadata is read with an exact allowlist and bytes items only where the caller's state
  declares a non-tensor, with ``weights_only=True``; a checkpoint can carry tensors and DCP's own
  bookkeeping, never code. Load a sharded checkpoint at any layout (or on one device) with::

      state = model.state_dict()      # templates at the current layout
      load_sharded(state, ckpt_dir)   # instead of dcp.load(state, checkpoint_id=ckpt_dir)
      model.load_state_dict(state)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_moe.checkpoint.security import SafeFileSystemReader, SafeLoadPlanner, load_sharded
from lightning_moe.compat import compute_local_shape_and_global_offset
from lightning_moe.parallel.expert_parallel import ExpertStateConverter, expert_shard, is_expert_param

__all__ = [
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "distribute_full_tensors",
    "init_optimizer_state",
    "load_optimizer_state_dict",
    "load_sharded",
    "optimizer_param_groups",
    "optimizer_state_dict",
]


def _params_by_index(optimizer: Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}


def _local_view(value: Tensor, target: DTensor) -> DTensor:
    """``value`` (a full global tensor) as a DTensor laid out like ``target``, its local tensor this
    rank's box of ``value`` (as DCP computes it): a view on the CPU, a copy of the box alone on
    another device."""
    mesh, placements = target.device_mesh, target.placements
    shape, offset = compute_local_shape_and_global_offset(value.shape, mesh, placements)
    local = value
    for dim, (start, size) in enumerate(zip(offset, shape)):
        local = local.narrow(dim, start, size)
    # Cut first, then move: only the slice goes to the device (on the CPU, no copy at all).
    return DTensor.from_local(local.to(target.device), mesh, placements, run_check=False, shape=value.shape,
                              stride=value.stride())


def distribute_full_tensors(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (full global tensors, e.g. a consolidated file) with each value whose tensor in
    ``model`` is a tensor-parallel or FSDP2 DTensor cut to this rank's shard of it.

    ``load_state_dict`` cannot copy a plain tensor into a DTensor. Expert tensors are left to the
    experts' own load hooks. Every rank holds the full values (e.g. a memory-mapped file), so
    nothing is communicated; the shards are views of them, so nothing is copied either (the load
    copies each view into its parameter).
    """
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    out = dict(state)
    for key, value in state.items():
        target = targets.get(key)
        if isinstance(target, DTensor) and not isinstance(value, DTensor) and not is_expert_param(target):
            if tuple(value.shape) != tuple(target.shape):
                continue  # load_state_dict reports the size mismatch, naming the key
            out[key] = _local_view(value, target)
    return out


def init_optimizer_state(optimizer: Optimizer) -> None:
    """Create the optimizer's per-parameter state (moments) without changing any parameter.

    DCP loads into existing tensors, so a fresh optimizer needs its state allocated first: one
    step with zero gradients and a learning rate of 0.
    """
    if optimizer.state:
        return
    params = _params_by_index(optimizer)
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            group["lr"] = lr
        for p, grad in zip(params, saved_grads):
            p.grad = grad


def optimizer_state_dict(model: nn.Module, optimizer: Optimizer, converter: ExpertStateConverter | None) -> dict:
    """Per-parameter optimizer state keyed by parameter name; expert states as global DTensors."""
    names = _names(model)
    state: dict[str, dict[str, Tensor]] = {}
    for p in _params_by_index(optimizer):
        if p not in optimizer.state:
            continue
        shard = expert_shard(p)
        entries = {}
        for key, value in optimizer.state[p].items():
            if not isinstance(value, Tensor):
                value = torch.tensor(value)
            if shard is not None and converter is not None and value.shape == p.shape:
                value = converter.to_global(value, shard)
            entries[key] = value
        state[names[id(p)]] = entries
    return state


def optimizer_param_groups(model: nn.Module, optimizer: Optimizer) -> list[dict]:
    """The optimizer's param groups with parameter names instead of tensors (hyperparameters only)."""
    names = _names(model)
    groups = []
    for group in optimizer.param_groups:
        entry = {k: (v.item() if isinstance(v, Tensor) and v.numel() == 1 else v) for k, v in group.items() if k != "params"}
        entry["params"] = [names[id(p)] for p in group["params"]]
        groups.append(entry)
    return groups


def load_optimizer_state_dict(
    model: nn.Module,
    optimizer: Optimizer,
    state: dict[str, dict[str, Tensor]],
    param_groups: list[dict] | None,
    converter: ExpertStateConverter | None,
) -> None:
    """Load what :func:`optimizer_state_dict` / :func:`optimizer_param_groups` produced, at any layout."""
    names = _names(model)
    params = _params_by_index(optimizer)
    torch_state = {}
    for index, p in enumerate(params):
        entries = state.get(names[id(p)])
        if entries is None:
            continue
        shard = expert_shard(p)
        local = {}
        for key, value in entries.items():
            if shard is not None and converter is not None and converter.accepts(value, shard):
                value = converter.to_local(value, shard, p.shape[0], name=f"{names[id(p)]}/{key}")
            elif isinstance(value, DTensor) and not isinstance(p, DTensor):
                value = value.full_tensor()  # saved sharded, loaded into a plain parameter
            local[key] = value
        torch_state[index] = local
    groups = []
    offset = 0
    for i, group in enumerate(optimizer.param_groups):
        entry = {k: v for k, v in group.items() if k != "params"}
        if param_groups is not None:
            saved = param_groups[i]
            expected = [names[id(p)] for p in group["params"]]
            # Under pipeline parallelism this rank holds some stages only (in a schedule's own
            # order): compare the saved names it holds, as sets. Weights missing from the model are
            # caught by the model's strict load.
            held = set(names.values())
            saved_here = [name for name in saved["params"] if name in held]
            if set(saved_here) != set(expected) or len(saved_here) != len(expected):
                raise ValueError(
                    f"Optimizer param group {i} holds {len(expected)} parameters that differ from the "
                    f"checkpoint's {len(saved_here)}; the model or its optimizer groups changed."
                )
            entry.update({k: v for k, v in saved.items() if k != "params"})
        entry["params"] = list(range(offset, offset + len(group["params"])))
        offset += len(group["params"])
        groups.append(entry)
    optimizer.load_state_dict({"state": torch_state, "param_groups": groups})
