"""All-gather token dispatcher over the ETP x EP group (Megatron's ``allgather``).

Every rank of the ETP x EP group gathers the tokens, probabilities and routing maps of all the
others, runs its local experts on the rows routed to them (each ETP shard computes a partial fc2
output), and a reduce-scatter sums the partial outputs of every rank back to the tokens' owners.
Simple and sync-light, but it moves every token to every rank, whether routed there or not:
``DispatchStats`` reports those bytes so the excess over the all-to-all is visible.

Unlike upstream, ranks may hold different numbers of tokens: the sizes are exchanged first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.permute import expert_order
from lightning_moe.layers.routing import padded_expert_rows
from lightning_moe.parallel.collectives import all_gather_v, gather_sizes, reduce_scatter_v
from lightning_moe.parallel.dispatchers.stats import DispatchStats
from lightning_moe.parallel.layout.groups import ParallelContext

__all__ = ["AllGatherDispatcher", "AllGatherMetadata"]


@dataclass(frozen=True)
class AllGatherMetadata:
    """What `AllGatherDispatcher.combine` needs to undo one dispatch."""

    token_sizes: list[int]
    """Tokens of every rank of the ETP x EP group (the gather / reduce-scatter sizes)."""
    row_index: Tensor
    """Gathered-token index of every expert-major row of this rank's local experts."""


class AllGatherDispatcher:
    """Gather all tokens over ETP x EP, compute the local experts, reduce-scatter the outputs."""

    def __init__(self, config: MoEConfig, ctx: ParallelContext) -> None:
        self.config = config
        ctx.dims.validate_num_experts(config.num_experts)
        self.group = ctx.group("etp_ep")
        self.group_rank = ctx.rank_in("etp_ep")
        self.num_local_experts = config.num_experts // ctx.size("ep")
        self.first_expert = ctx.rank_in("ep") * self.num_local_experts
        self.stats = DispatchStats()

    def dispatch(
        self, hidden: Tensor, probs: Tensor, routing_map: Tensor
    ) -> tuple[Tensor, list[int], Tensor, AllGatherMetadata]:
        """Gather everything, then pick the rows of this rank's experts."""
        num_tokens = torch.tensor([hidden.shape[0]], device=hidden.device)
        token_sizes = gather_sizes(num_tokens, self.group).view(-1).tolist()  # host read 1
        all_hidden = all_gather_v(hidden, token_sizes, self.group)
        all_probs = all_gather_v(probs, token_sizes, self.group)
        with torch.no_grad():
            all_map = all_gather_v(routing_map.to(torch.uint8), token_sizes, self.group).bool()
        local = slice(self.first_expert, self.first_expert + self.num_local_experts)
        local_map, local_probs = all_map[:, local], all_probs[:, local]
        if self.config.pad_to_capacity:
            # Each rank's router marked exactly its capacity per expert: static counts.
            per_rank = [
                padded_expert_rows(n, self.config.top_k, self.config.num_experts, self.config.capacity_factor)
                for n in token_sizes
            ]
            counts = [sum(per_rank)] * self.num_local_experts
        else:
            counts = local_map.sum(0).tolist()  # host read 2
        row_index, row_probs = expert_order(local_map, local_probs, num_out_tokens=sum(counts))
        self._account(hidden, probs, routing_map, token_sizes)
        return all_hidden, counts, row_probs, AllGatherMetadata(token_sizes, row_index)

    def combine(self, expert_out: Tensor, metadata: AllGatherMetadata) -> Tensor:
        """Sum every rank's (partial) outputs for this rank's tokens."""
        sizes = metadata.token_sizes
        others = sum(sizes) - sizes[self.group_rank]
        row_bytes = expert_out.shape[1] * expert_out.element_size()
        self.stats.combine_bytes += others * row_bytes
        # Every other rank's partial sum of this rank's rows.
        self.stats.combine_bytes_received += sizes[self.group_rank] * (len(sizes) - 1) * row_bytes
        return reduce_scatter_v(expert_out, sizes, self.group)

    def _account(self, hidden: Tensor, probs: Tensor, routing_map: Tensor, token_sizes: list[int]) -> None:
        peers = len(token_sizes) - 1
        row_bytes = hidden.shape[1] * hidden.element_size() + probs.shape[1] * (probs.element_size() + 1)
        self.stats.rows_sent += hidden.shape[0] * peers
        self.stats.dispatch_bytes += hidden.shape[0] * peers * row_bytes
        self.stats.dispatch_bytes_received += (sum(token_sizes) - hidden.shape[0]) * row_bytes
        self.stats.dispatches += 1
        if self.config.capacity_factor is not None and torch.is_grad_enabled():
            kept = (routing_map & (probs > 0)).sum()
            self.stats.add_dropped(routing_map.shape[0] * self.config.top_k - kept)
