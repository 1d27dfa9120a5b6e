"""All-to-all token dispatcher over expert parallelism (EP), with expert tensor parallelism (ETP).

Token flow (docs/numerics.md §8 and §10), per micro-batch:

1. permutation 1: this rank's routed (token, expert) rows in expert-major order, so the rows
   for each EP rank are contiguous;
2. all-to-all over EP with uneven splits: every rank receives the rows for its local experts,
   ordered ``[source EP rank][local expert]``;
3. with ETP > 1, an all-gather over ETP (uneven sizes) so every ETP shard of an expert sees all
   of its rows: ``[source ETP rank][source EP rank][local expert]``;
4. permutation 2 to expert-major order is not materialised: ``metadata.row_index`` lets the
   expert kernel gather its rows and scatter its outputs back in place;
5. combine mirrors it: reduce-scatter over ETP (summing the partial fc2 outputs), the reverse
   all-to-all, and a scatter-add of the rows back to their tokens.

Split sizes need the token counts of every rank: in dropless (and capacity-dropping) mode they
are all-gathered over the ETP x EP group and read to the host once per dispatch, the only
device-to-host synchronisation. In drop-and-pad mode every (rank, expert) pair carries exactly
``capacity`` rows, so all sizes are static and nothing is read from the device; that mode needs
the same number of tokens on every rank (as upstream). That is checked once, on the first
dispatch of each dispatcher (every rank dispatches it together), with one small all-gather and a
device-side assert on accelerators; later dispatches pay nothing for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.permute import expert_order, unpermute
from lightning_moe.layers.routing import padded_expert_rows
from lightning_moe.parallel.collectives import all_gather_v, all_to_all, gather_sizes, reduce_scatter_v
from lightning_moe.parallel.context import ParallelContext
from lightning_moe.parallel.dispatchers.stats import DispatchStats

__all__ = ["AllToAllDispatcher", "AllToAllMetadata"]


@dataclass(frozen=True)
class AllToAllMetadata:
    """What `AllToAllDispatcher.combine` needs to undo one dispatch."""

    num_tokens: int
    """Tokens of this rank (rows of the combined output)."""
    send_index: Tensor
    """Token index of every row this rank sent (permutation 1, expert-major)."""
    input_splits: list[int]
    """Rows sent to each EP rank."""
    output_splits: list[int]
    """Rows received from each EP rank."""
    etp_sizes: list[int]
    """Rows each ETP rank received from its all-to-all (the ETP all-gather sizes)."""
    row_index: Tensor | None
    """Expert-major order of the received rows (None when they already are, e.g. one local expert)."""
    row_index_is_permutation: bool = True
    """``row_index`` names every received row exactly once: the experts may scatter their outputs
    back with a deterministic ``index_copy`` instead of an accumulating ``index_add``."""


class AllToAllDispatcher:
    """Megatron's ``alltoall`` dispatcher over the EP and ETP groups of a `ParallelContext`."""

    def __init__(self, config: MoEConfig, ctx: ParallelContext) -> None:
        self.config = config
        dims = ctx.dims
        dims.validate_num_experts(config.num_experts)
        self.ep_group, self.etp_group = ctx.group("ep"), ctx.group("etp")
        self.ep_size, self.etp_size = ctx.size("ep"), ctx.size("etp")
        self.ep_rank, self.etp_rank = ctx.rank_in("ep"), ctx.rank_in("etp")
        self.etp_ep_group = ctx.group("etp_ep")
        self.num_local_experts = config.num_experts // self.ep_size
        # Row i of the counts gathered over ETP x EP belongs to the rank at (etp, ep) coordinate:
        member_coords = [dims.coords(rank) for rank in ctx.ranks("etp_ep")]
        self._gather_row_of = {(c.etp, c.ep): i for i, c in enumerate(member_coords)}
        self.stats = DispatchStats()
        self._token_counts_checked = False

    # -- split bookkeeping ------------------------------------------------------------------------

    def _local_chunk_sizes(self, counts: list[list[int]]) -> list[int]:
        """Rows received per chunk, chunks ordered ``[src etp][src ep][local expert]``."""
        first = self.ep_rank * self.num_local_experts
        local = range(first, first + self.num_local_experts)
        return [
            counts[self._gather_row_of[(etp, ep)]][e]
            for etp in range(self.etp_size)
            for ep in range(self.ep_size)
            for e in local
        ]

    def _expert_major_index(self, chunk_sizes: list[int], device: torch.device) -> Tensor | None:
        """Row order that regroups ``[src][local expert]`` chunks by local expert (permutation 2)."""
        nle = self.num_local_experts
        if nle == 1:
            return None
        sizes = torch.tensor(chunk_sizes, dtype=torch.int64, device=device)
        starts = torch.cumsum(sizes, 0) - sizes
        order = torch.arange(len(chunk_sizes), device=device).view(-1, nle).t().reshape(-1)
        sizes, starts = sizes[order], starts[order]
        total = int(sum(chunk_sizes))
        # Row j of the sorted output is row (j - first row of its chunk) of that chunk.
        offsets = torch.repeat_interleave(starts - (torch.cumsum(sizes, 0) - sizes), sizes, output_size=total)
        return torch.arange(total, device=device) + offsets

    def _counts(self, routing_map: Tensor) -> list[list[int]]:
        """Per-(rank, expert) row counts of every rank of the ETP x EP group, as host lists."""
        num_tokens, num_experts = routing_map.shape
        if self.config.pad_to_capacity:
            if not self._token_counts_checked:
                self._check_equal_token_counts(routing_map)
                self._token_counts_checked = True
            rows = padded_expert_rows(num_tokens, self.config.top_k, num_experts, self.config.capacity_factor)
            return [[rows] * num_experts for _ in self._gather_row_of]
        local = routing_map.sum(0)
        return gather_sizes(local, self.etp_ep_group).tolist()  # the one device-to-host read

    def _check_equal_token_counts(self, routing_map: Tensor) -> None:
        """Drop-and-pad sizes are computed from this rank's token count alone: all must agree.

        Run on the first dispatch only (an all-gather every forward would cost a collective per
        layer and micro-batch for a property of the data pipeline). Checked without a host read on
        accelerators (a device-side assert); on CPU the comparison is a plain host check.
        """
        local = torch.tensor([routing_map.shape[0]], device=routing_map.device)
        counts = gather_sizes(local, self.etp_ep_group).view(-1)
        equal = (counts == local).all()
        message = (
            "drop-and-pad (pad_to_capacity=True) with the alltoall dispatcher needs the same number of "
            "tokens on every rank of the expert-parallel group (static split sizes); got different counts. "
            "Use equal micro-batches, or the allgather dispatcher."
        )
        if routing_map.device.type == "cpu":
            if not bool(equal):
                raise ValueError(f"{message} Token counts: {counts.tolist()}.")
        else:
            torch._assert_async(equal, message)

    # -- protocol ---------------------------------------------------------------------------------

    def dispatch(
        self, hidden: Tensor, probs: Tensor, routing_map: Tensor
    ) -> tuple[Tensor, list[int], Tensor, AllToAllMetadata]:
        """Send every routed row to the EP rank that holds its expert (and to its ETP peers)."""
        counts = self._counts(routing_map)
        mine = counts[self._gather_row_of[(self.etp_rank, self.ep_rank)]]
        nle = self.num_local_experts
        send_index, send_probs = expert_order(
            routing_map, probs, num_out_tokens=sum(mine), drop_and_pad=self.config.pad_to_capacity
        )
        input_splits = [sum(mine[r * nle : (r + 1) * nle]) for r in range(self.ep_size)]
        chunk_sizes = self._local_chunk_sizes(counts)
        per_ep_source = [sum(chunk_sizes[i * nle : (i + 1) * nle]) for i in range(self.etp_size * self.ep_size)]
        output_splits = per_ep_source[self.etp_rank * self.ep_size : (self.etp_rank + 1) * self.ep_size]
        etp_sizes = [sum(per_ep_source[j * self.ep_size : (j + 1) * self.ep_size]) for j in range(self.etp_size)]

        rows = all_to_all(hidden.index_select(0, send_index), output_splits, input_splits, self.ep_group)
        row_probs = all_to_all(send_probs, output_splits, input_splits, self.ep_group)
        if self.etp_size > 1:
            rows = all_gather_v(rows, etp_sizes, self.etp_group)
            row_probs = all_gather_v(row_probs, etp_sizes, self.etp_group)
        row_index = self._expert_major_index(chunk_sizes, hidden.device)
        tokens_per_local_expert = [sum(chunk_sizes[le::nle]) for le in range(nle)]
        if row_index is not None:
            row_probs = row_probs.index_select(0, row_index)

        self._account_dispatch(hidden, input_splits, output_splits, etp_sizes, routing_map, probs)
        metadata = AllToAllMetadata(hidden.shape[0], send_index, input_splits, output_splits, etp_sizes, row_index)
        return rows, tokens_per_local_expert, row_probs, metadata

    def combine(self, expert_out: Tensor, metadata: AllToAllMetadata) -> Tensor:
        """Sum ETP partials, send the rows home and add them up per token."""
        rows = expert_out
        if self.etp_size > 1:
            rows = reduce_scatter_v(rows, metadata.etp_sizes, self.etp_group)
        rows = all_to_all(rows, metadata.input_splits, metadata.output_splits, self.ep_group)
        self._account_combine(expert_out, metadata)
        return unpermute(rows, metadata.send_index, metadata.num_tokens)

    # -- accounting (host integers, no synchronisation) ------------------------------------------

    def _account_dispatch(self, hidden, input_splits, output_splits, etp_sizes, routing_map, probs) -> None:
        row_bytes = hidden.shape[1] * hidden.element_size() + probs.element_size()
        remote_rows = sum(input_splits) - input_splits[self.ep_rank]
        # The ETP all-gather sends this rank's received rows to each of its ETP peers.
        etp_rows = etp_sizes[self.etp_rank] * (self.etp_size - 1)
        received = sum(output_splits) - output_splits[self.ep_rank] + sum(etp_sizes) - etp_sizes[self.etp_rank]
        self.stats.rows_sent += remote_rows
        self.stats.dispatch_bytes += (remote_rows + etp_rows) * row_bytes
        self.stats.dispatch_bytes_received += received * row_bytes
        self.stats.dispatches += 1
        if self.config.capacity_factor is not None and torch.is_grad_enabled():
            kept = (routing_map & (probs > 0)).sum()
            self.stats.add_dropped(routing_map.shape[0] * self.config.top_k - kept)

    def _account_combine(self, expert_out: Tensor, metadata: AllToAllMetadata) -> None:
        row_bytes = expert_out.shape[1] * expert_out.element_size()
        etp_rows = sum(metadata.etp_sizes) - metadata.etp_sizes[self.etp_rank]
        remote_rows = sum(metadata.output_splits) - metadata.output_splits[self.ep_rank]
        self.stats.combine_bytes += (etp_rows + remote_rows) * row_bytes
        # The mirror image: the ETP peers' partial sums of this rank's rows, then the rows sent home.
        own = metadata.etp_sizes[self.etp_rank]
        received = own * (self.etp_size - 1) + sum(metadata.input_splits) - metadata.input_splits[self.ep_rank]
        self.stats.combine_bytes_received += received * row_bytes

