"""What the ``alltoall`` and ``flex`` dispatchers share: groups, per-source sizes and the combine.

Both send rows over the EP group with one all-to-all (uneven splits), all-gather the received rows
over ETP so every ETP shard of an expert sees them, and undo it in ``combine``: a reduce-scatter
over ETP sums the partial fc2 outputs of the ETP shards, the reverse all-to-all sends every row
home and a scatter-add sums the rows of each token. They differ in what one row is: a
(token, expert) pair for ``alltoall``, a (token, destination EP rank) pair for ``flex``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.permute import unpermute
from lightning_moe.parallel.collectives import all_to_all, reduce_scatter_v
from lightning_moe.parallel.dispatchers.stats import DispatchStats
from lightning_moe.parallel.layout.groups import ParallelContext

__all__ = ["AllToAllMetadata", "ExpertParallelAllToAll"]


@dataclass(frozen=True)
class AllToAllMetadata:
    """What the combine of the all-to-all dispatchers (``alltoall``, ``flex``) needs to undo one dispatch."""

    num_tokens: int
    """Tokens of this rank (rows of the combined output)."""
    send_index: Tensor
    """Token index of every row this rank sent, in send order (grouped by destination EP rank)."""
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


class ExpertParallelAllToAll:
    """Base of the dispatchers that move rows with an all-to-all over EP and an all-gather over ETP.

    Holds the groups, sizes and ranks of the layout, the row of every ETP x EP rank in a gathered
    count tensor, the combine and its byte accounting; subclasses implement ``dispatch``.
    """

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

    def _per_source(self, counts: list[list[int]], columns: range | list[int]) -> list[int]:
        """``counts[source][c]`` for every source of this rank's rows: ``[src etp][src ep][column]``.

        ``counts`` holds one row per rank of the ETP x EP group (as gathered); the sources are the
        ranks whose rows this rank holds after the EP all-to-all and the ETP all-gather, in the
        order those collectives concatenate them.
        """
        return [
            counts[self._gather_row_of[(etp, ep)]][c]
            for etp in range(self.etp_size)
            for ep in range(self.ep_size)
            for c in columns
        ]

    def combine(self, expert_out: Tensor, metadata: AllToAllMetadata) -> Tensor:
        """Sum ETP partials, send the rows home and add them up per token."""
        rows = expert_out
        if self.etp_size > 1:
            rows = reduce_scatter_v(rows, metadata.etp_sizes, self.etp_group)
        rows = all_to_all(rows, metadata.input_splits, metadata.output_splits, self.ep_group)
        self._account_combine(expert_out, metadata)
        return unpermute(rows, metadata.send_index, metadata.num_tokens)

    # -- accounting (host integers, no synchronisation) ------------------------------------------

    def _account_dropped(self, routing_map: Tensor, probs: Tensor) -> None:
        """Capacity-dropped assignments of this forward (a device tensor, no host read)."""
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
