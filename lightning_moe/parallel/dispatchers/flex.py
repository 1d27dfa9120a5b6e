"""The ``flex`` token dispatcher: every token crosses the wire once per EP rank that needs it.

The ``alltoall`` dispatcher sends one row per (token, expert) pair, so a token whose top-k experts
share an EP rank travels there several times. ``flex`` (Megatron's name for the DeepEP / HybridEP
dispatchers) sends each token once to each EP rank holding at least one of its experts, and the
expert side sums its experts' prob-weighted outputs for the token before sending one row back.

Token flow of the pure PyTorch backend (``flex_backend="torch"``), per micro-batch:

1. the (destination EP rank, token) pairs with at least one routed expert on that rank, grouped
   by destination and ascending by token: ``send_index``;
2. three all-to-alls over EP with those splits: the token rows ``[D, H]``; the probabilities of
   the routed (token, local expert) assignments, flat ``[A]`` (row by row, experts ascending
   within a row); and, with more than one local expert, a bitmask per row naming the destination's
   local experts it is routed to (``ceil(E_local / 8)`` bytes, no gradient);
3. with ETP > 1, an all-gather of the three over ETP, as ``alltoall`` does;
4. the local expansion: ``metadata.row_index`` gives the received row of every expert-major
   (local expert, row) assignment, ``row_probs`` its probability. The experts gather their rows
   through it and scatter-add their prob-weighted outputs back into the received-row layout
   (``row_index_is_permutation=False``): that sum *is* the per-(token, rank) weighted sum, and
   the probabilities are applied exactly once, inside the experts, as on one device;
5. combine, shared with ``alltoall``: reduce-scatter over ETP, the reverse all-to-all (one row
   per (token, rank)) and a scatter-add of the rows onto their tokens. Backward mirrors all of it
   through the differentiable collectives.

Bytes: dispatch ``D * H * b + A * p`` and combine ``D * H * b``, the deduplicated minimum
(``benchmarks/dispatch.py``), plus ``D * ceil(E_local / 8)`` bytes of bitmasks, counted apart as
``DispatchStats.dispatch_index_bytes``.

Split sizes: one all-gather over ETP x EP of this rank's rows per EP rank and assignments per
expert, read to the host once per dispatch: the only device-to-host synchronisation, in every
mode. Drop-and-pad keeps the rows the local dispatcher's static order keeps (``capacity`` per
expert, so the expert counts stay static), but how many tokens share a rank still depends on the
routing: unlike ``alltoall``, flex reads the sizes in that mode too, and so also accepts different
token counts per rank.
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

__all__ = [
    "FLEX_BACKENDS", "FlexDispatcher", "expand_rows", "make_flex_dispatcher", "pack_bits", "resolve_flex_backend",
    "unpack_bits",
]

FLEX_BACKENDS = ("auto", "torch", "deepep")
"""``flex_backend`` values: ``torch`` (this module), ``deepep`` (DeepEP's fused kernels, CUDA) and
``auto`` (DeepEP on CUDA where it is installed and supports the layer, else torch)."""

_BITS = 8


def pack_bits(mask: Tensor) -> Tensor:
    """``[R, n]`` bool to ``[R, ceil(n / 8)]`` uint8, bit ``j % 8`` of byte ``j // 8`` = column ``j``."""
    rows, n = mask.shape
    nbytes = -(-n // _BITS)
    padded = torch.cat([mask, mask.new_zeros(rows, nbytes * _BITS - n)], dim=1)
    shifts = torch.arange(_BITS, device=mask.device, dtype=torch.int32)
    return (padded.view(rows, nbytes, _BITS).to(torch.int32) << shifts).sum(-1).to(torch.uint8)


def unpack_bits(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: ``[R, ceil(n / 8)]`` uint8 to ``[R, n]`` bool."""
    shifts = torch.arange(_BITS, device=packed.device, dtype=torch.int32)
    bits = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return bits.view(packed.shape[0], packed.shape[1] * _BITS)[:, :n].bool()


def expand_rows(local_map: Tensor, num_assignments: int) -> tuple[Tensor, Tensor]:
    """The expert-major (local expert, row) assignments of ``local_map [N, E_local]`` (bool).

    Returns ``(row_index, order)``, both ``[num_assignments]`` (the number of True entries, known
    to the caller; nothing is read from the device): the row of every assignment, expert-major
    with rows ascending within an expert as :func:`~lightning_moe.layers.permute.expert_order`,
    and the assignment's position among the True entries taken row by row (the order in which
    the probabilities arrive).
    """
    num_experts = local_map.shape[1]
    row_index, _ = expert_order(local_map, None, num_out_tokens=num_assignments)
    # Rank of each (row, expert) entry among the row-major True entries.
    row_major_rank = torch.cumsum(local_map.reshape(-1), 0, dtype=torch.int64) - 1
    expert_of = torch.repeat_interleave(
        torch.arange(num_experts, device=local_map.device), local_map.sum(0), output_size=num_assignments
    )
    return row_index, row_major_rank.index_select(0, row_index * num_experts + expert_of)


class FlexDispatcher(ExpertParallelAllToAll):
    """The deduplicating ``flex`` dispatcher in pure PyTorch (module docstring).

    Groups, the combine and its accounting are those of ``alltoall``
    (:class:`~lightning_moe.parallel.dispatchers.ep_alltoall.ExpertParallelAllToAll`); only what
    a row is differs: one per (token, destination EP rank).
    """

    backend = "torch"
    """The ``flex_backend`` this class implements."""

    def __init__(self, config: MoEConfig, ctx: ParallelContext) -> None:
        super().__init__(config, ctx)
        # One local expert: every received row is one assignment, nothing to say about it.
        self.mask_bytes = 0 if self.num_local_experts == 1 else -(-self.num_local_experts // _BITS)

    def _kept_map(self, routing_map: Tensor) -> Tensor:
        """The (token, expert) pairs the experts compute: the routing map, or in drop-and-pad mode
        exactly the ``capacity`` rows per expert that the local dispatcher's static order takes."""
        if not self.config.pad_to_capacity:
            return routing_map
        num_tokens, num_experts = routing_map.shape
        capacity = padded_expert_rows(num_tokens, self.config.top_k, num_experts, self.config.capacity_factor)
        order, _ = expert_order(routing_map, None, capacity * num_experts, drop_and_pad=True)
        kept = routing_map.new_zeros(num_experts, num_tokens).scatter_(1, order.view(num_experts, capacity), True)
        return kept.t()

    def _sizes(self, pair_map: Tensor, kept: Tensor) -> list[list[int]]:
        """Rows per EP rank and assignments per expert of every ETP x EP rank: ``[G][EP + E]`` host lists."""
        local = torch.cat([pair_map.sum(1), kept.sum(0)]).to(torch.int64)
        return gather_sizes(local, self.etp_ep_group).tolist()  # the one device-to-host read

    def dispatch(
        self, hidden: Tensor, probs: Tensor, routing_map: Tensor
    ) -> tuple[Tensor, list[int], Tensor, AllToAllMetadata]:
        """Send every token once to each EP rank holding one of its experts, with its probs there."""
        num_tokens = hidden.shape[0]
        ep, etp, nle = self.ep_size, self.etp_size, self.num_local_experts
        kept = self._kept_map(routing_map)
        # [EP, T, E_local]: destination-major, tokens ascending, local experts ascending, the order
        # in which rows and assignments are sent.
        by_rank = kept.reshape(num_tokens, ep, nle).transpose(0, 1)
        pair_map = by_rank.any(-1)  # [EP, T]: token t has a row for rank r
        counts = self._sizes(pair_map, kept)

        # Split sizes, all from the host lists: rows (one per (token, rank)) and assignments.
        mine = counts[self._gather_row_of[(self.etp_rank, self.ep_rank)]]
        input_splits = mine[:ep]
        input_assign = [sum(mine[ep + r * nle : ep + (r + 1) * nle]) for r in range(ep)]
        first = ep + self.ep_rank * nle
        source_rows = self._per_source(counts, [self.ep_rank])  # [src etp][src ep]
        chunks = self._per_source(counts, range(first, first + nle))  # [src etp][src ep][local expert]
        source_assign = [sum(chunks[i * nle : (i + 1) * nle]) for i in range(etp * ep)]
        own = slice(self.etp_rank * ep, (self.etp_rank + 1) * ep)
        output_splits, output_assign = source_rows[own], source_assign[own]
        etp_sizes = [sum(source_rows[j * ep : (j + 1) * ep]) for j in range(etp)]
        etp_assign = [sum(source_assign[j * ep : (j + 1) * ep]) for j in range(etp)]
        tokens_per_local_expert = [sum(chunks[le::nle]) for le in range(nle)]

        # Send side: nonzero_static takes the counts from the host lists (no further read).
        pairs = torch.nonzero_static(pair_map.reshape(-1), size=sum(input_splits)).squeeze(1)
        send_index = pairs % num_tokens if num_tokens else pairs
        assignments = torch.nonzero_static(by_rank.reshape(-1), size=sum(input_assign)).squeeze(1)
        send_probs = probs.reshape(num_tokens, ep, nle).transpose(0, 1).reshape(-1).index_select(0, assignments)

        rows = all_to_all(hidden.index_select(0, send_index), output_splits, input_splits, self.ep_group)
        row_probs = all_to_all(send_probs, output_assign, input_assign, self.ep_group)
        masks = None
        if self.mask_bytes:
            with torch.no_grad():
                send_masks = pack_bits(by_rank.reshape(ep * num_tokens, nle).index_select(0, pairs))
                masks = all_to_all(send_masks, output_splits, input_splits, self.ep_group)
        if etp > 1:
            rows = all_gather_v(rows, etp_sizes, self.etp_group)
            row_probs = all_gather_v(row_probs, etp_assign, self.etp_group)
            if masks is not None:
                masks = all_gather_v(masks, etp_sizes, self.etp_group)

        row_index = None  # one local expert: the received rows are its rows, in order
        if masks is not None:
            row_index, order = expand_rows(unpack_bits(masks, nle), sum(tokens_per_local_expert))
            row_probs = row_probs.index_select(0, order)

        self._account_dispatch(hidden, probs, routing_map, input_splits, input_assign, output_splits,
                               output_assign, etp_sizes, etp_assign)
        # A received row with several local experts is summed into by each: not a permutation.
        metadata = AllToAllMetadata(num_tokens, send_index, input_splits, output_splits, etp_sizes, row_index, False)
        return rows, tokens_per_local_expert, row_probs, metadata

    # -- accounting (host integers, no synchronisation) ------------------------------------------

    def _account_dispatch(self, hidden, probs, routing_map, input_splits, input_assign, output_splits,
                          output_assign, etp_sizes, etp_assign) -> None:
        hidden_bytes, prob_bytes = hidden.shape[1] * hidden.element_size(), probs.element_size()
        peers = self.etp_size - 1
        # Sent: remote rows of the EP all-to-all, then this rank's received rows to each ETP peer.
        rows = sum(input_splits) - input_splits[self.ep_rank] + etp_sizes[self.etp_rank] * peers
        assign = sum(input_assign) - input_assign[self.ep_rank] + etp_assign[self.etp_rank] * peers
        rows_in = sum(output_splits) - output_splits[self.ep_rank] + sum(etp_sizes) - etp_sizes[self.etp_rank]
        assign_in = sum(output_assign) - output_assign[self.ep_rank] + sum(etp_assign) - etp_assign[self.etp_rank]
        self.stats.rows_sent += sum(input_splits) - input_splits[self.ep_rank]
        self.stats.dispatch_bytes += rows * hidden_bytes + assign * prob_bytes
        self.stats.dispatch_bytes_received += rows_in * hidden_bytes + assign_in * prob_bytes
        self.stats.dispatch_index_bytes += rows * self.mask_bytes
        self.stats.dispatch_index_bytes_received += rows_in * self.mask_bytes
        self.stats.dispatches += 1
        self._account_dropped(routing_map, probs)


def resolve_flex_backend(backend: str, config: MoEConfig, ctx: ParallelContext) -> str:
    """The backend ``flex_backend=backend`` stands for on ``ctx`` for layers of ``config``.

    ``auto`` is ``deepep`` on CUDA when DeepEP is importable and supports the layout and routing
    (:func:`~lightning_moe.parallel.dispatchers.deepep.deepep_problems`), else ``torch``; an
    explicit ``deepep`` that cannot run raises (ImportError without DeepEP, ValueError otherwise).
    """
    from lightning_moe.parallel.dispatchers import deepep  # its import of deep_ep is lazy

    if backend not in FLEX_BACKENDS:
        raise ValueError(f"Unknown flex_backend {backend!r}; choose one of {list(FLEX_BACKENDS)}.")
    if backend == "auto":
        usable = deepep.deep_ep_available() and not deepep.deepep_problems(config, ctx)
        return "deepep" if usable else "torch"
    if backend == "deepep":
        deepep.import_deep_ep()
        problems = deepep.deepep_problems(config, ctx)
        if problems:
            raise ValueError(problems[0])
    return backend


def make_flex_dispatcher(config: MoEConfig, ctx: ParallelContext, backend: str = "auto"):
    """The ``flex`` dispatcher of ``backend`` (see :func:`resolve_flex_backend`)."""
    if resolve_flex_backend(backend, config, ctx) == "deepep":
        from lightning_moe.parallel.dispatchers.deepep import DeepEPFlexDispatcher

        return DeepEPFlexDispatcher(config, ctx)
    return FlexDispatcher(config, ctx)
