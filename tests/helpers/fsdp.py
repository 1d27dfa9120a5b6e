"""What FSDP2 holds and does, read from its (private) state: roots, collectives per unit, gradients held.

FSDP2 has no public view of these: the tests below read ``FSDPModule._get_fsdp_state()`` and its
parameter groups (torch 2.13 names), as ``lightning_moe.parallel.sharded_grad_sync`` does, and patch
the module-level collectives of ``torch.distributed.fsdp._fully_shard._fsdp_param_group`` to see
which unit all-gathers or reduce-scatters when.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from unittest import mock

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.tensor import DTensor

__all__ = ["held_gradients", "record_collectives", "root_states", "states_of", "unit_names"]


def states_of(modules: Iterable[nn.Module]) -> list:
    """The distinct FSDP2 states of the FSDP units among ``modules`` (and inside them), in module order."""
    seen: dict[int, object] = {}
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                state = sub._get_fsdp_state()
                seen.setdefault(id(state), state)
    return list(seen.values())


def root_states(modules: Iterable[nn.Module]) -> list:
    """The states among ``modules``' units that FSDP2 made roots (set at the first forward)."""
    return [state for state in states_of(modules) if state._is_root]


def unit_names(model: nn.Module, extra: dict[str, nn.Module] | None = None) -> dict[int, str]:
    """id of each FSDP parameter (``FSDPParam``) -> the name of its unit in ``model`` (or in ``extra``)."""
    named = dict(model.named_modules())
    named.update(extra or {})
    names: dict[int, str] = {}
    for name, module in named.items():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    names.setdefault(id(fsdp_param), name)
    return names


@contextmanager
def record_collectives(names: dict[int, str], events: list) -> Iterator[list]:
    """Append ``("gather", unit)`` for every all-gather FSDP2 issues and ``("reduce", unit)`` for every
    reduce-scatter, in the order they are issued (``names`` from :func:`unit_names`)."""
    gather, reduce = _fsdp_param_group.foreach_all_gather, _fsdp_param_group.foreach_reduce

    def gathered(fsdp_params, *args, **kwargs):
        events.append(("gather", names.get(id(fsdp_params[0]), "?")))
        return gather(fsdp_params, *args, **kwargs)

    def reduced(fsdp_params, *args, **kwargs):
        events.append(("reduce", names.get(id(fsdp_params[0]), "?")))
        return reduce(fsdp_params, *args, **kwargs)

    with mock.patch.object(_fsdp_param_group, "foreach_all_gather", gathered), \
            mock.patch.object(_fsdp_param_group, "foreach_reduce", reduced):
        yield events


def held_gradients(modules: Iterable[nn.Module]) -> dict[str, int]:
    """Gradient elements the units of ``modules`` hold now.

    ``sharded``: in the parameters' ``.grad`` (what the optimizer reads; a DTensor's local shard);
    ``unsharded``: in FSDP2's own slots for gradients not reduce-scattered yet (the unsharded
    parameter's ``.grad`` and the accumulated gradient of a reduce dtype), full size on every rank.
    """
    sharded = unsharded = 0
    for state in states_of(modules):
        for group in state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                grad = fsdp_param.sharded_param.grad
                if grad is not None:
                    sharded += (grad.to_local() if isinstance(grad, DTensor) else grad).numel()
                whole = getattr(fsdp_param, "_unsharded_param", None)
                for held in (None if whole is None else whole.grad, fsdp_param.unsharded_accumulated_grad):
                    if held is not None:
                        unsharded += (held.to_local() if isinstance(held, DTensor) else held).numel()
    return {"sharded": sharded, "unsharded": unsharded}
