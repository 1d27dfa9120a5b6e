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
dispatch of each dispatcher (every rank dispatches it together), with one small all-gather read
to the host (on accelerators too: a device-side assert would abort the process without saying
why); later dispatches pay nothing for it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.permute import expert_order
from lightning_moe.layers.routing import padded_expert_rows
from lightning_moe.parallel.collectives import all_gather_v, all_to_all, gather_sizes
from lightning_moe.parallel.dispatchers.ep_alltoall import AllToAllMetadata, ExpertParallelAllToAll
from lightning_moe.parallel.layout.groups import ParallelContext

__all__ = ["AllToAllDispatcher", "AllToAllMetadata"]


class AllToAllDispatcher(ExpertParallelAllToAll):
    """Megatron's ``alltoall`` dispatcher over the EP and ETP groups of a `ParallelContext`.

    One row per routed (token, expert) pair; groups, combine and its accounting come from
    :class:`~lightning_moe.parallel.dispatchers.ep_alltoall.ExpertParallelAllToAll`.
    """

    def __init__(self, config: MoEConfig, ctx: ParallelContext) -> None:
        super().__init__(config, ctx)
        self._token_counts_checked = False

    # -- split bookkeeping ------------------------------------------------------------------------

    def _local_chunk_sizes(self, counts: list[list[int]]) -> list[int]:
        """Rows received per chunk, chunks ordered ``[src etp][src ep][local expert]``."""
        first = self.ep_rank * self.num_local_experts
        return self._per_source(counts, range(first, first + self.num_local_experts))

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
        layer and micro-batch for a property of the data pipeline). The gathered counts are read
        to the host once, on every device, so a mismatch is a ``ValueError`` naming the counts
        (``torch._assert_async`` on an accelerator would be an unrecoverable device assert with
        no message).
        """
        local = torch.tensor([routing_map.shape[0]], device=routing_map.device)
        counts = gather_sizes(local, self.etp_ep_group).view(-1).tolist()  # the first dispatch's one host read
        if len(set(counts)) > 1:
            raise ValueError(
                "drop-and-pad (pad_to_capacity=True) with the alltoall dispatcher needs the same number of "
                "tokens on every rank of the expert-parallel group (static split sizes); got token counts "
                f"{counts} over the ETP x EP group. Use equal micro-batches on every rank, or the allgather "
                "dispatcher."
            )

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
        self._account_dropped(routing_map, probs)
