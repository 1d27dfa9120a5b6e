"""The ``flex`` dispatcher on DeepEP's fused all-to-all kernels (``flex_backend="deepep"``, CUDA).

DeepEP (deepseek-ai/DeepEP) moves each token once to every EP rank holding one of its top-k
experts and sums the rows sent back per token, the protocol of the torch backend
(:mod:`lightning_moe.parallel.dispatchers.flex`): ``dispatch`` returns the received rows (one
per (source token, this rank)) with ``metadata.row_index`` expanding them to expert-major
assignments, the experts scatter-add their prob-weighted outputs back into the received rows,
and ``combine`` hands those rows to DeepEP's combine. ``deep_ep.Buffer`` picks its intranode
(NVLink) or internode (RDMA + NVLink) kernels from the group; one buffer per EP group is kept
and grown when a layer needs more room. Its layout (``get_dispatch_layout``) comes from the
routing as ``topk_idx [T, top_k]`` (global expert ids, -1 for none) with the probabilities as
``topk_weights``.

Limits, each refused with the reason (``flex_backend="torch"`` handles them all):

* CUDA, expert parallelism > 1 and expert tensor parallelism 1;
* at most ``top_k`` experts per token: no drop-and-pad filler rows, no ``router_padding_alignment``;
* DeepEP moves bf16 rows and fp32 probabilities: other hidden dtypes are cast for the transfer
  and the combined output comes back in the input's dtype (fp32 states are rounded to bf16).

Synchronisation: DeepEP's dispatch waits on the host for the received counts (its one read);
the byte statistics read the per-rank counts through a pinned copy queued before it.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.permute import expert_order
from lightning_moe.parallel.dispatchers.ep_alltoall import ExpertParallelAllToAll
from lightning_moe.parallel.layout.groups import ParallelContext

__all__ = ["DeepEPFlexDispatcher", "DeepEPMetadata", "deep_ep_available", "deepep_problems", "import_deep_ep"]

_INSTALL_HINT = (
    "flex_backend='deepep' needs DeepEP's Python package deep_ep, which is not importable here. DeepEP is not "
    "published on PyPI by its authors: build github.com/deepseek-ai/DeepEP from source against this CUDA and "
    "NVSHMEM (its README), or use flex_backend='torch' (pure PyTorch, same results; 'auto' picks it)."
)
_SUPPORTED_DEVICE_TYPES = ("cuda",)
_TRANSFER_DTYPE = torch.bfloat16
"""Dtype of the rows DeepEP moves (its normal kernels take bf16 or an FP8 pair)."""
_WEIGHT_DTYPE = torch.float32
"""Dtype DeepEP takes for ``topk_weights``."""


def deep_ep_available() -> bool:
    """True when ``import deep_ep`` would find the package (it is not imported)."""
    return importlib.util.find_spec("deep_ep") is not None


def import_deep_ep():
    """The ``deep_ep`` module, or ImportError naming the extra and the alternative."""
    try:
        return importlib.import_module("deep_ep")
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err


def deepep_problems(config: MoEConfig, ctx: ParallelContext) -> list[str]:
    """Every reason the DeepEP backend cannot serve layers of ``config`` on ``ctx`` (empty: it can)."""
    fix = "use flex_backend='torch' (or 'auto', which falls back to it)"
    problems = []
    if ctx.device_type not in _SUPPORTED_DEVICE_TYPES:
        problems.append(f"flex_backend='deepep' runs on CUDA only (DeepEP kernels); this layout is on "
                        f"{ctx.device_type!r}: {fix}.")
    if ctx.size("ep") == 1:
        problems.append(f"flex_backend='deepep' needs expert_parallel_size > 1 (DeepEP has no one-rank kernels): {fix}.")
    if ctx.size("etp") != 1:
        problems.append(
            f"flex_backend='deepep' supports expert_tensor_parallel_size=1, got {ctx.size('etp')}: {fix}."
        )
    if config.pad_to_capacity:
        problems.append(f"flex_backend='deepep' cannot send drop-and-pad filler rows (pad_to_capacity=True puts "
                        f"more than top_k experts on a token): {fix}.")
    if config.router_padding_alignment is not None:
        problems.append(f"flex_backend='deepep' cannot send the filler rows of router_padding_alignment="
                        f"{config.router_padding_alignment} (more than top_k experts on a token): {fix}.")
    return problems


def _topk_layout(routing_map: Tensor, probs: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """``(topk_idx [T, k] int64, topk_weights [T, k] fp32)`` of a map with at most ``k`` experts per token.

    Routed experts ascending, then -1 (capacity-dropped slots); weights 0 on -1 slots.
    """
    num_experts = routing_map.shape[1]
    k = min(top_k, num_experts)
    # Routed expert e scores E - e (> 0), unrouted 0: the top k are the routed ones, ascending.
    score = torch.where(routing_map, num_experts - torch.arange(num_experts, device=routing_map.device), 0)
    values, _ = score.topk(k, dim=1)
    valid = values > 0
    topk_idx = torch.where(valid, num_experts - values, -1)
    weights = probs.gather(1, topk_idx.clamp(min=0)).to(_WEIGHT_DTYPE) * valid
    return topk_idx, weights


_BUFFERS: dict[Any, Any] = {}


def _buffer(deep_ep, group, hidden_bytes: int):
    """The cached ``deep_ep.Buffer`` of ``group``, (re)built when ``hidden_bytes`` needs more room.

    Creating one is collective over the group; every rank dispatches the same layers in the same
    order, so all of them grow it at the same dispatch.
    """
    size = group.size()
    nvl = rdma = 0
    for config in (deep_ep.Buffer.get_dispatch_config(size), deep_ep.Buffer.get_combine_config(size)):
        nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, size))
        rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, size))
    buffer = _BUFFERS.get(group)
    if buffer is None or buffer.num_nvl_bytes < nvl or buffer.num_rdma_bytes < rdma:
        buffer = _BUFFERS[group] = deep_ep.Buffer(group, nvl, rdma)
    return buffer


@dataclass
class _Handle:
    """DeepEP's communication handle of one dispatch, filled by its forward, used by the combine."""

    buffer: Any
    handle: Any = None
    tokens_per_expert: list[int] = field(default_factory=list)


class _Dispatch(torch.autograd.Function):
    """DeepEP dispatch; backward is its combine of the row and weight gradients."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, layout, state: _Handle):
        per_rank, per_rdma_rank, per_expert, in_rank = layout
        recv_x, recv_idx, recv_weights, counts, handle, _ = state.buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        )
        state.handle, state.tokens_per_expert = handle, list(counts)
        ctx.state = state
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_weights, recv_idx

    @staticmethod
    def backward(ctx, grad_x, grad_weights, _grad_idx):
        weights = None if grad_weights is None else grad_weights.to(_WEIGHT_DTYPE).contiguous()
        grad_in, grad_w, _ = ctx.state.buffer.combine(grad_x.contiguous(), ctx.state.handle, topk_weights=weights)
        return grad_in, grad_w, None, None, None


class _Combine(torch.autograd.Function):
    """DeepEP combine (rows summed per token); backward is a cached-layout dispatch."""

    @staticmethod
    def forward(ctx, rows, state: _Handle):
        combined, _, _ = state.buffer.combine(rows, state.handle)
        ctx.state = state
        return combined

    @staticmethod
    def backward(ctx, grad):
        grad_rows, *_ = ctx.state.buffer.dispatch(grad.contiguous(), handle=ctx.state.handle)
        return grad_rows, None


@dataclass(frozen=True)
class DeepEPMetadata:
    """What `DeepEPFlexDispatcher.combine` needs to undo one dispatch."""

    state: _Handle
    """DeepEP's buffer and handle of the dispatch."""
    dtype: torch.dtype
    """Dtype of the dispatched hidden states (the combined output's)."""
    row_index: Tensor
    """Received row of every expert-major (local expert, row) assignment."""
    rows_sent: int
    """Rows this rank sent to other ranks (the combine receives as many back)."""
    rows_received: int
    """Rows this rank received from other ranks (the combine sends as many back)."""
    row_index_is_permutation: bool = False
    """Rows with several local experts appear several times: the experts sum into them."""


class DeepEPFlexDispatcher(ExpertParallelAllToAll):
    """The ``flex`` dispatcher on DeepEP (module docstring); same protocol as the torch backend."""

    backend = "deepep"
    """The ``flex_backend`` this class implements."""

    def __init__(self, config: MoEConfig, ctx: ParallelContext) -> None:
        self._deep_ep = import_deep_ep()
        problems = deepep_problems(config, ctx)
        if problems:
            raise ValueError(problems[0])
        super().__init__(config, ctx)

    def dispatch(
        self, hidden: Tensor, probs: Tensor, routing_map: Tensor
    ) -> tuple[Tensor, list[int], Tensor, DeepEPMetadata]:
        """DeepEP's dispatch of the tokens, then the local expansion to expert-major assignments."""
        nle, num_experts = self.num_local_experts, self.config.num_experts
        topk_idx, topk_weights = _topk_layout(routing_map, probs, self.config.top_k)
        x = hidden.to(_TRANSFER_DTYPE).contiguous()
        buffer = _buffer(self._deep_ep, self.ep_group, x.shape[1] * x.element_size())
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        sizes = _HostSizes(per_rank)  # [EP] rows this rank sends to each rank
        state = _Handle(buffer)
        recv_x, recv_weights, recv_idx = _Dispatch.apply(
            x, topk_weights, topk_idx, (per_rank, per_rdma_rank, per_expert, in_rank), state
        )
        # recv_idx holds local expert ids (-1: an expert of another rank); slots are distinct experts.
        valid = recv_idx >= 0
        slot = recv_idx.clamp(min=0)
        local_map = torch.zeros(recv_idx.shape[0], nle, dtype=torch.int32, device=recv_idx.device)
        local_map = local_map.scatter_add(1, slot, valid.to(torch.int32)) > 0
        local_probs = recv_weights.new_zeros(recv_idx.shape[0], nle).scatter_add(1, slot, recv_weights * valid)
        counts = state.tokens_per_expert
        row_index, row_probs = expert_order(local_map, local_probs, num_out_tokens=sum(counts))
        sent, received = self._account_dispatch(x, recv_x, topk_idx, sizes.read(), routing_map, probs)
        metadata = DeepEPMetadata(state, hidden.dtype, row_index, sent, received)
        return recv_x, counts, row_probs.to(probs.dtype), metadata

    def combine(self, expert_out: Tensor, metadata: DeepEPMetadata) -> Tensor:
        """DeepEP's combine: every rank's row of each token, summed onto the token."""
        rows = expert_out.to(_TRANSFER_DTYPE).contiguous()
        row_bytes = rows.shape[1] * rows.element_size()
        self.stats.combine_bytes += metadata.rows_received * row_bytes
        self.stats.combine_bytes_received += metadata.rows_sent * row_bytes
        return _Combine.apply(rows, metadata.state).to(metadata.dtype)

    def _account_dispatch(self, x, recv_x, topk_idx, sizes: list[int], routing_map, probs) -> tuple[int, int]:
        """Count the dispatch; returns (rows sent to, rows received from) other ranks."""
        rows, own_rows = sum(sizes) - sizes[self.ep_rank], sizes[self.ep_rank]
        received = recv_x.shape[0] - own_rows
        # DeepEP sends with every row its hidden state, top-k weights (fp32) and top-k ids (int64).
        k = topk_idx.shape[1]
        row_bytes = x.shape[1] * x.element_size() + k * torch.finfo(_WEIGHT_DTYPE).bits // 8
        self.stats.rows_sent += rows
        self.stats.dispatch_bytes += rows * row_bytes
        self.stats.dispatch_bytes_received += received * row_bytes
        self.stats.dispatch_index_bytes += rows * k * topk_idx.element_size()
        self.stats.dispatch_index_bytes_received += received * k * topk_idx.element_size()
        self.stats.dispatches += 1
        self._account_dropped(routing_map, probs)
        return rows, received


class _HostSizes:
    """A small device tensor copied to pinned host memory without waiting, read later.

    Queued before DeepEP's dispatch, whose host wait for the received counts comes after it on the
    stream: by the time :meth:`read` runs, the copy has finished and reading costs nothing.
    """

    def __init__(self, values: Tensor) -> None:
        self.event = None
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = values

    def read(self) -> list[int]:
        """The values as host ints (waits for the copy, which is normally done)."""
        if self.event is not None:
            self.event.synchronize()
        return [int(v) for v in self.host.tolist()]
