"""The token-dispatcher protocol, and the local (single-device) dispatcher.

A dispatcher moves routed tokens to the experts that hold them and the expert outputs back:

* ``dispatch(hidden [T, H], probs [T, E], routing_map [T, E])`` returns
  ``(rows, tokens_per_local_expert, row_probs, metadata)``. ``tokens_per_local_expert`` is a host
  list of ints or an int64 ``[E_local]`` tensor on the rows' device (the experts accept both: the
  ``grouped_mm`` kernel builds its offsets from a device tensor without reading it, the loop
  kernel reads it); ``row_probs`` is the routing probability of each expert-major row.
  ``metadata.row_index`` says where each expert-major row comes from: None when ``rows`` is
  already in expert-major order, otherwise ``rows[row_index[i]]`` is row ``i``. Letting the
  experts gather (and scatter back) themselves saves materialising permuted copies. An optional
  ``metadata.row_index_is_permutation`` (default False) declares that ``row_index`` holds every
  row of ``rows`` exactly once, so the experts scatter back with ``index_copy`` (deterministic)
  instead of ``index_add``.
* ``combine(expert_out, metadata)`` takes the expert outputs, laid out like ``rows`` (scattered
  back through ``row_index`` and summed when it is set), and returns ``[T, H]``.

Metadata is returned, never stored on the dispatcher (docs/architecture.md §3), so a dispatcher can be
shared and re-entered (recompute, several micro-batches in flight).

The local dispatcher reads nothing from the device in dropless routing (the row count is
``T * top_k``, the counts stay a device tensor) and in drop-and-pad mode (static counts); with
capacity dropping or routing-map padding the row count depends on the routing: one host read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.permute import expert_order
from lightning_moe.layers.routing import padded_expert_rows

__all__ = ["LocalDispatchMetadata", "LocalDispatcher", "TokenDispatcher", "local_expert_counts", "routed_row_counts"]


class TokenDispatcher(Protocol):
    """What `MoELayer` needs from a dispatcher (see the module docstring)."""

    def dispatch(
        self, hidden: Tensor, probs: Tensor, routing_map: Tensor
    ) -> tuple[Tensor, list[int] | Tensor, Tensor, Any]:
        """Send routed tokens to their experts."""
        ...

    def combine(self, expert_out: Tensor, metadata: Any) -> Tensor:
        """Bring expert outputs back to their tokens and sum them."""
        ...


def local_expert_counts(routing_map: Tensor, config: MoEConfig) -> list[int]:
    """Rows per expert of ``routing_map`` as a host list.

    With ``pad_to_capacity`` every expert gets exactly the capacity (static, no host read);
    otherwise the counts are read from the device: one synchronisation.
    """
    num_tokens, num_experts = routing_map.shape
    if config.pad_to_capacity:
        return [padded_expert_rows(num_tokens, config.top_k, num_experts, config.capacity_factor)] * num_experts
    return routing_map.sum(0).tolist()


def routed_row_counts(routing_map: Tensor, config: MoEConfig) -> tuple[list[int] | Tensor, int]:
    """Rows per expert of ``routing_map`` and their total, reading the device only where unavoidable.

    * drop-and-pad: the static capacity for every expert (host list, no read);
    * dropless without routing-map padding: the counts as an int64 device tensor and the static
      total ``T * top_k`` (top-k marks exactly ``top_k`` distinct experts per token), no read;
    * capacity dropping or ``router_padding_alignment``: the total depends on the routing, so the
      counts are read to the host (one synchronisation).
    """
    if config.capacity_factor is None and config.router_padding_alignment is None:  # dropless
        return routing_map.sum(0, dtype=torch.int64), routing_map.shape[0] * config.top_k
    counts = local_expert_counts(routing_map, config)
    return counts, sum(counts)


@dataclass(frozen=True)
class LocalDispatchMetadata:
    """What the local dispatcher's combine needs: nothing but the fused gather index."""

    row_index: Tensor
    """Token index of every expert-major row (repeats for tokens routed to several experts)."""


class LocalDispatcher:
    """All experts on this device: the permutation is fused into the expert kernel.

    ``dispatch`` returns the tokens unpermuted with ``row_index`` set, so the experts gather their
    rows and sum their outputs per token; ``combine`` is then the identity.
    """

    def __init__(self, config: MoEConfig) -> None:
        self.config = config

    def dispatch(
        self, hidden: Tensor, probs: Tensor, routing_map: Tensor
    ) -> tuple[Tensor, list[int] | Tensor, Tensor, LocalDispatchMetadata]:
        """Expert-major order of the routed (token, expert) pairs, without copying tokens."""
        counts, num_rows = routed_row_counts(routing_map, self.config)
        row_index, row_probs = expert_order(
            routing_map, probs, num_out_tokens=num_rows, drop_and_pad=self.config.pad_to_capacity
        )
        return hidden, counts, row_probs, LocalDispatchMetadata(row_index)

    def combine(self, expert_out: Tensor, metadata: LocalDispatchMetadata) -> Tensor:
        """The experts already summed their outputs per token."""
        return expert_out
