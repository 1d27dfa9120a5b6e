"""One FSDP2 root per model (or pipeline stage), and the explicit prefetch order of its blocks.

FSDP2 keeps its communication state (the all-gather and reduce-scatter streams, the order units ran
in, the end-of-backward callback) on a *root* unit, shared with every unit inside it. Units that
are not inside one root each become a root of their own at their first forward, with their own
streams: a block's backward then never prefetches the previous block's all-gather, and nothing
overlaps across units. :func:`~lightning_moe.parallel.fully_shard.apply_fully_shard` therefore
shards the model itself last, as the root (under pipeline parallelism each stage module), and:

* :func:`claim_units` makes that root the root of its units at the first forward of *any* of
  them. FSDP2 picks the root lazily, as the first unit whose forward runs, which is the model only
  if its own ``forward`` is what the training step calls; a LightningModule's ``training_step``
  that calls ``self.model(x)``, or a pipeline stage's shape probe that runs only the head, would
  otherwise make the first piece a root of its own;
* :func:`set_chain_prefetch` sets explicit prefetching along the model's chain of units (the
  embedding, the blocks in order, the final norm and head), as torchtitan does for MoE models: in
  forward each unit starts the all-gather of the next unit and of the units nested in it (a MoE
  block's experts, which live on the expert mesh), in backward those of the previous unit. FSDP2's
  implicit prefetch issues the next all-gather only when the CPU reaches the next unit, which the
  host syncs of expert-parallel dispatch (split sizes read from the device) delay until the
  current block's compute is done; explicit prefetch issues it at the current unit's start. Two
  blocks (with their experts) are then gathered at a time instead of one.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_moe.compat import fsdp_lazy_init, fsdp_state

__all__ = ["claim_units", "set_chain_prefetch"]


def claim_units(root: FSDPModule) -> None:
    """Make ``root`` the FSDP2 root of every unit inside it at the first forward of any of them.

    A forward pre-hook on each unit, ahead of FSDP2's own, runs the root's lazy initialisation
    (FSDP2's ``_lazy_init``: private, torch 2.13) once, then every such hook is removed. It runs
    at the first forward rather than now because FSDP2 checks the parameters then (no meta tensor
    left; dtypes after the precision plugin's conversion).
    """
    state = fsdp_state(root)
    handles = []

    def claim(module: nn.Module, args, kwargs):
        fsdp_lazy_init(state)  # a no-op when the root's own forward ran first
        for handle in handles:
            handle.remove()

    for unit in root.modules():
        if unit is not root and isinstance(unit, FSDPModule):
            handles.append(unit.register_forward_pre_hook(claim, prepend=True, with_kwargs=True))


def _with_nested(unit: FSDPModule) -> list[FSDPModule]:
    """``unit`` and the units nested inside it (a MoE block's experts), in module order."""
    own = fsdp_state(unit)
    nested = [m for m in unit.modules() if isinstance(m, FSDPModule) and fsdp_state(m) is not own]
    return [unit, *nested]


def set_chain_prefetch(chain: Sequence[FSDPModule]) -> None:
    """Prefetch along ``chain``, the units in the order their forward runs (module docstring).

    A unit that appears twice (tied embedding and head sharded as one unit) prefetches what
    follows each of its appearances.
    """
    forward: dict[int, tuple[FSDPModule, list[FSDPModule]]] = {}
    backward: dict[int, tuple[FSDPModule, list[FSDPModule]]] = {}
    for i, unit in enumerate(chain):
        key = id(fsdp_state(unit))
        forward.setdefault(key, (unit, []))
        backward.setdefault(key, (unit, []))
        if i + 1 < len(chain) and fsdp_state(chain[i + 1]) is not fsdp_state(unit):
            forward[key][1].extend(_with_nested(chain[i + 1]))
        if i > 0 and fsdp_state(chain[i - 1]) is not fsdp_state(unit):
            backward[key][1].extend(_with_nested(chain[i - 1]))
    for unit, targets in forward.values():
        if targets:
            unit.set_modules_to_forward_prefetch(targets)
    for unit, targets in backward.values():
        if targets:
            unit.set_modules_to_backward_prefetch(targets)
