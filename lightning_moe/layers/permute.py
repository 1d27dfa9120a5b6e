"""Token permutation between token order and expert order, with Megatron Core semantics.

``permute`` groups the (token, expert) assignments of a routing map by expert so each expert sees
one contiguous block of rows; ``unpermute`` sums the expert outputs back into token order. The
row order is part of the numerics contract (docs/numerics.md §8): **expert-major, token index
ascending within an expert**, exactly as ``megatron.core.transformer.moe.moe_utils.permute``.

``pad_routing_map`` is the router padding for quantised grouped GEMMs (docs/numerics.md §12,
``moe_utils.pad_routing_map``) and ``tokens_per_expert`` the per-expert row counts.
``gather_rows``/``scatter_rows`` move rows through a row index for the expert kernels; when the
index is a pure permutation (each row exactly once) both directions use ``index_copy``, which is
deterministic on every device (CUDA's ``index_add`` accumulates with atomics).

Everything here is a pure function of tensors: differentiable w.r.t. tokens and probs, no Python
loop over experts or tokens, and no device-to-host synchronisation except where documented
(``permute(num_out_tokens=None)``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "check_permutation_sizes", "expert_order", "gather_rows", "pad_routing_map", "permute", "scatter_rows",
    "tokens_per_expert", "unpermute",
]


def _check_routing_map(routing_map: Tensor) -> None:
    if routing_map.dtype != torch.bool:
        raise TypeError(
            f"routing_map must be a bool tensor [tokens, experts], got dtype {routing_map.dtype}."
        )
    if routing_map.dim() != 2:
        raise ValueError(f"routing_map must have shape [tokens, experts], got {tuple(routing_map.shape)}.")


def _check_permute_inputs(
    tokens: Tensor, routing_map: Tensor, probs: Tensor | None, num_out_tokens: int | None
) -> None:
    _check_routing_map(routing_map)
    if tokens.dim() != 2:
        raise ValueError(f"tokens must have shape [tokens, hidden], got {tuple(tokens.shape)}.")
    if tokens.shape[0] != routing_map.shape[0]:
        raise ValueError(
            f"tokens has {tokens.shape[0]} rows but routing_map has {routing_map.shape[0]}; "
            "both must be indexed by the same tokens."
        )
    if probs is not None and probs.shape != routing_map.shape:
        raise ValueError(
            f"probs has shape {tuple(probs.shape)} but routing_map has {tuple(routing_map.shape)}; "
            "pass the dense [tokens, experts] probabilities."
        )
    if num_out_tokens is not None and not 0 <= num_out_tokens <= routing_map.numel():
        raise ValueError(
            f"num_out_tokens={num_out_tokens} must be between 0 and tokens*experts={routing_map.numel()}."
        )


def permute(
    tokens: Tensor,
    routing_map: Tensor,
    probs: Tensor | None = None,
    num_out_tokens: int | None = None,
    drop_and_pad: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Gather the routed copies of ``tokens`` into expert-major order (Megatron ``moe_utils.permute``).

    Args:
        tokens: ``[T, H]`` hidden states, one row per token.
        routing_map: ``[T, E]`` bool, True where token t is sent to expert e.
        probs: optional ``[T, E]`` routing probabilities; the entry of every output row is
            returned in the same order (zero outside the routed entries, as the router leaves them).
        num_out_tokens: number of output rows N.

            * Dropless: ``None`` counts ``routing_map.sum()``, which **copies a number to the host
              (a device synchronisation)**. Passing the count yourself avoids it; ``T*K`` is static
              for dropless top-k routing. The value must equal the number of True entries (a larger
              one would leave rows without a token; it is not checked, which would need a sync).
            * ``drop_and_pad``: required, ``capacity * E``.
        drop_and_pad: static-shape mode for capacity routing (docs/numerics.md §4). Every expert
            gets exactly ``capacity = num_out_tokens // E`` rows: its marked tokens in ascending
            token order (the first ``capacity`` of them if there are more) followed, only if fewer
            than ``capacity`` are marked, by the lowest unmarked token indices. The router's pad step
            normally marks exactly ``capacity`` tokens per expert already (filler rows with prob 0),
            so the fillers are then interleaved by token index. No host synchronisation.

    Returns:
        ``(permuted_tokens [N, H], permuted_probs [N] or None, sorted_indices [N] int64)`` where row
        ``i`` is a copy of ``tokens[sorted_indices[i]]``. Rows are grouped by expert, expert 0 first,
        with token indices ascending within each expert; ``tokens_per_expert(routing_map)`` gives
        the group sizes (dropless) and every group has ``capacity`` rows (drop-and-pad).
    """
    _check_permute_inputs(tokens, routing_map, probs, num_out_tokens)
    sorted_indices, permuted_probs = expert_order(routing_map, probs, num_out_tokens, drop_and_pad)
    permuted_tokens = tokens.index_select(0, sorted_indices)
    return permuted_tokens, permuted_probs, sorted_indices


def expert_order(
    routing_map: Tensor,
    probs: Tensor | None = None,
    num_out_tokens: int | None = None,
    drop_and_pad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The row order of :func:`permute` without gathering the tokens: ``(sorted_indices, permuted_probs)``.

    Expert kernels that gather rows themselves (a fused permute) need only these. Arguments and
    synchronisation rules are those of :func:`permute`.
    """
    num_tokens, num_experts = routing_map.shape
    # Expert-major view [E, T]; int8 because sorting bool is not supported on every backend.
    expert_major_map = routing_map.T.to(torch.int8)

    if drop_and_pad:
        if num_out_tokens is None:
            raise ValueError(
                "drop_and_pad=True needs num_out_tokens=capacity*num_experts (static output shape); got None."
            )
        if num_out_tokens % num_experts:
            raise ValueError(
                f"drop_and_pad=True needs num_out_tokens divisible by num_experts={num_experts} "
                f"(capacity*num_experts); got {num_out_tokens}."
            )
        # capacity <= num_tokens follows from the num_out_tokens <= T*E check above.
        capacity = num_out_tokens // num_experts
        # One batched stable sort per expert row: marked tokens first in ascending order, then the
        # unmarked ones in ascending order; the first `capacity` columns are the kept rows.
        order = torch.argsort(expert_major_map, dim=1, descending=True, stable=True)[:, :capacity]
        sorted_indices = order.reshape(-1)
        permuted_probs = None if probs is None else probs.T.gather(1, order).reshape(-1)
    else:
        if num_out_tokens is None:
            num_out_tokens = int(routing_map.sum())  # device -> host sync, see docstring
        # The True entries of the flattened expert-major [E*T] map, in position order e*T + t:
        # expert-major with ascending tokens (upstream's exact order). nonzero_static takes the
        # count from the caller (no host sync) and is ~8x cheaper than a stable argsort.
        flat_positions = torch.nonzero_static(
            expert_major_map.reshape(-1), size=num_out_tokens, fill_value=-1
        ).squeeze(1)
        sorted_indices = flat_positions % num_tokens if num_tokens else flat_positions
        permuted_probs = None if probs is None else probs.T.reshape(-1).index_select(0, flat_positions)

    return sorted_indices, permuted_probs


def unpermute(
    permuted: Tensor,
    sorted_indices: Tensor,
    num_tokens: int,
    probs: Tensor | None = None,
) -> Tensor:
    """Sum expert-ordered rows back into token order (Megatron ``moe_utils.unpermute``).

    ``out[t] = sum over rows i with sorted_indices[i] == t of permuted[i] (* probs[i])``, computed
    as an ``index_add`` into zeros, so a token routed to K experts receives the sum of its K rows
    and a token routed nowhere receives zeros. Works unchanged for drop-and-pad rows (filler rows
    carry prob 0, or expert outputs that the caller has already scaled by 0).

    Like upstream, the multiply by ``probs`` (optional; the training path applies probs inside the
    experts instead) follows type promotion, so bf16 rows with fp32 probs are accumulated in fp32;
    the result is cast back to ``permuted.dtype``.

    Args:
        permuted: ``[N, H]`` rows in the order produced by :func:`permute`.
        sorted_indices: ``[N]`` int64 token index of every row (third output of :func:`permute`).
        num_tokens: number of tokens T of the restored ``[T, H]`` output.
        probs: optional ``[N]`` per-row weights (second output of :func:`permute`).
    """
    if permuted.dim() != 2:
        raise ValueError(f"permuted must have shape [rows, hidden], got {tuple(permuted.shape)}.")
    if sorted_indices.shape != permuted.shape[:1]:
        raise ValueError(
            f"sorted_indices has shape {tuple(sorted_indices.shape)} but permuted has "
            f"{permuted.shape[0]} rows; they must match."
        )
    if probs is not None and probs.shape != permuted.shape[:1]:
        raise ValueError(
            f"probs has shape {tuple(probs.shape)} but permuted has {permuted.shape[0]} rows; "
            "pass the [rows] permuted probabilities."
        )
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}.")
    input_dtype = permuted.dtype
    weighted = permuted if probs is None else permuted * probs.unsqueeze(-1)
    restored = weighted.new_zeros(num_tokens, permuted.shape[1])
    restored = restored.index_add(0, sorted_indices, weighted)
    return restored.to(input_dtype)


def tokens_per_expert(routing_map: Tensor) -> Tensor:
    """Rows each expert receives from :func:`permute` (dropless): ``routing_map.sum(0)``, ``[E]`` int64.

    Stays on the routing map's device (no host synchronisation); callers that need host split
    sizes (e.g. a grouped GEMM) copy it themselves at the point of their choosing.
    """
    _check_routing_map(routing_map)
    return routing_map.sum(dim=0, dtype=torch.int64)


def pad_routing_map(routing_map: Tensor, alignment: int) -> Tensor:
    """Mark extra tokens so every expert's count is a multiple of ``alignment`` (Megatron ``pad_routing_map``).

    For each expert with ``c`` routed tokens, the first ``(-c) mod alignment`` unrouted tokens
    (lowest token indices first) are marked too, for quantised grouped GEMMs that need aligned
    segment sizes (docs/numerics.md §12). Experts with no tokens stay empty. The
    probabilities are not touched: the filler entries are already 0 there, so the filler rows
    contribute nothing to the output. If an expert has fewer unrouted tokens than it needs, all of
    them are marked (its count then cannot reach the multiple).

    Returns a new ``[T, E]`` bool map; the input is not modified.
    """
    _check_routing_map(routing_map)
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}.")
    counts = routing_map.sum(dim=0, dtype=torch.int64)
    fillers_needed = (-counts) % alignment
    unrouted = ~routing_map
    # 1-based rank of every unrouted entry within its expert column, in token order; the ones with
    # rank <= fillers_needed are exactly the lowest-index zeros to flip.
    unrouted_rank = torch.cumsum(unrouted, dim=0, dtype=torch.int64)
    fillers = unrouted & (unrouted_rank <= fillers_needed.unsqueeze(0))
    return routing_map | fillers


def check_permutation_sizes(row_index: Tensor, num_out_rows: int, num_rows: int) -> None:
    """Refuse a row index declared a permutation whose sizes cannot be one (a host shape check).

    A permutation of ``num_out_rows`` rows has that many entries and gathers from that many rows;
    its scatters write every row exactly once, so outputs are not zero-filled first.
    """
    if row_index.shape[0] != num_out_rows or num_rows != num_out_rows:
        raise ValueError(
            f"row_index_is_permutation=True needs one row per output row: row_index has {row_index.shape[0]} "
            f"entries, the rows gathered from {num_rows}, num_out_rows={num_out_rows}. Pass "
            "row_index_is_permutation=False for a row index that repeats or skips rows."
        )


class _PermutationGather(torch.autograd.Function):
    """``src.index_select(0, index)`` for a permutation ``index``: backward is an ``index_copy``."""

    @staticmethod
    def forward(ctx, src: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        # Every source row receives exactly one row's gradient: no zero fill, no accumulation.
        return grad.new_empty(grad.shape).index_copy_(0, index, grad), None


def gather_rows(src: Tensor, index: Tensor, is_permutation: bool = False) -> Tensor:
    """``src[index]`` (rows), differentiable w.r.t. ``src``.

    Its backward scatter-adds the row gradients back (``index_add``), or with ``is_permutation``
    (``index`` holds each of the ``src.shape[0]`` rows exactly once) copies them (``index_copy``).
    """
    if not is_permutation:
        return src.index_select(0, index)
    check_permutation_sizes(index, src.shape[0], src.shape[0])
    return _PermutationGather.apply(src, index)


def scatter_rows(
    rows: Tensor, index: Tensor, num_out_rows: int, is_permutation: bool = False, dtype: torch.dtype | None = None
) -> Tensor:
    """``out[index[i]] += rows[i]`` into ``num_out_rows`` zero rows, summed in ``dtype`` (default: the rows').

    With ``is_permutation`` (each output row exactly once) the rows are copied (``index_copy``);
    the backward of both is a gather.
    """
    rows = rows if dtype is None else rows.to(dtype)
    if is_permutation:
        check_permutation_sizes(index, num_out_rows, rows.shape[0])
        return rows.new_empty(num_out_rows, rows.shape[1]).index_copy(0, index, rows)
    return rows.new_zeros(num_out_rows, rows.shape[1]).index_add(0, index, rows)
