"""Single-device oracles for the expert-parallel tests (``test_expert_parallel.py``).

Every rank of a distributed test knows the tokens of *all* ranks (they come from one seeded
generator), so it can compute on its own what the one-device `MoELayer` says each rank's share
must be. The oracles follow docs/architecture.md §9 and docs/numerics.md §4-§7:

* dropless routing: the layer applied to the gathered global batch (ranks' tokens concatenated);
* capacity dropping / drop-and-pad: the layer applied to each rank's own tokens (capacity is per
  rank), gradients summed over the ranks;
* aux / seq-aux losses: the layer applied to the concatenated tokens of each TP x CP group;
* z-loss: the layer applied to each rank's tokens with ``coeff / |TP x CP|``;
* global aux loss: the layer applied to the tokens of all TP x DP x CP ranks;
* `DispatchStats`: the rows and bytes each dispatcher must move, counted from the routing maps
  of every rank (:func:`expected_dispatch_stats`).

Nothing here calls ``torch.distributed``; the slicing of expert tensors is written out by hand
(not with the library's ``_local_slice``) so the layout it checks is the documented one.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
from torch import Tensor

from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.moe import MoELayer

__all__ = [
    "FP32_GRAD_TOL",
    "FP32_OUT_TOL",
    "INIT_STD",
    "Close",
    "build_reference",
    "compare",
    "expected_dispatch_stats",
    "expert_block",
    "layer_grads",
    "make_tokens",
    "reference_with",
    "run_reference",
    "split_rows",
]

# Tolerances, relative to the largest magnitude of the reference tensor compared (fp32 on both
# sides; only summation orders differ: rows gathered per expert, all-to-all / reduce-scatter sums
# in another order, gradients summed over ranks instead of over one batch).
FP32_OUT_TOL = 1e-5
"""Outputs: a few ulps per value."""
FP32_GRAD_TOL = 1e-4
"""Gradients add reductions over tokens, experts and ranks to the output error."""

# Larger than a training init (0.02) so router logits are spread out: no near-ties in any top-k
# (a tie could be broken differently on a rank's rows and on the gathered batch).
INIT_STD = 0.3


@dataclasses.dataclass(frozen=True)
class Close:
    """A measured difference: ``err = max|actual - expected|``, ``scale = max|expected|``."""

    err: float
    scale: float

    def ok(self, tol: float) -> bool:
        # Relative to the reference's magnitude; an all-zero reference must be matched to 1e-12.
        return self.err <= tol * max(self.scale, 1e-12 / tol)


def compare(actual: Tensor, expected: Tensor) -> Close:
    """Max abs difference and reference magnitude of two same-shaped tensors (shape checked)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    actual, expected = actual.detach().double(), expected.detach().double()
    err = (actual - expected).abs().max().item() if expected.numel() else 0.0
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return Close(err, scale)


def build_reference(config: MoEConfig, seed: int, expert_bias: Tensor | None = None) -> MoELayer:
    """The one-device layer every rank builds identically (same seed, optional expert bias)."""
    torch.manual_seed(seed)
    layer = MoELayer(config)
    if expert_bias is not None:
        with torch.no_grad():
            layer.router.expert_bias.copy_(expert_bias)
    return layer


def reference_with(layer: MoELayer, **config_changes) -> MoELayer:
    """A fresh copy of ``layer`` (same weights and buffers, zero grads) with a changed config."""
    config = dataclasses.replace(layer.config, **config_changes)
    clone = copy.deepcopy(layer)
    clone.config = config
    clone.router.config = config
    clone.dispatcher.config = config
    for param in clone.parameters():
        param.grad = None
    return clone


def make_tokens(shapes: list[tuple[int, ...]], seed: int, hidden: int, offset: float = 0.0) -> list[Tensor]:
    """One seeded random tensor per rank, of ``shape + (hidden,)``; ``offset`` is added to feature 0."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randn(*shape, hidden, generator=gen) for shape in shapes]
    for t in tokens:
        t[..., 0] += offset
    return tokens


def split_rows(full: Tensor, sizes: list[int], index: int, dim: int = 0) -> Tensor:
    """Part ``index`` of ``full`` cut along ``dim`` into consecutive pieces of ``sizes``."""
    start = sum(sizes[:index])
    return full.narrow(dim, start, sizes[index])


def run_reference(
    layer: MoELayer,
    xs: list[Tensor],
    dys: list[Tensor],
    cat_dim: int = 0,
    masks: list[Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Forward the concatenation of ``xs`` through ``layer``, backward with the concatenated ``dys``.

    ``masks`` (padding masks, one per part) are concatenated the same way. Returns
    ``(output, input grad)``; parameter grads accumulate in ``layer``.
    """
    x = torch.cat(xs, dim=cat_dim).requires_grad_()
    y = layer(x, None if masks is None else torch.cat(masks, dim=cat_dim))
    y.backward(torch.cat(dys, dim=cat_dim))
    return y.detach(), x.grad


def layer_grads(layer: MoELayer) -> dict[str, Tensor]:
    """Gradient of every parameter by state-dict name (zeros for parameters that got none)."""
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in layer.named_parameters()
    }


def expert_block(
    full: Tensor, name: str, ep_rank: int, num_local: int, etp_rank: int, etp_size: int, gated: bool
) -> Tensor:
    """The block of a global expert tensor, as the one-device layer stores it, that one (EP, ETP) rank holds.

    Local experts ``[ep_rank * num_local, (ep_rank + 1) * num_local)``; with ETP, of ``fc1_weight``
    stored as ``[E, 2F, H]`` (gated; the state dict's ``[E, 2, F, H]`` with dimensions 1 and 2
    merged) the ``etp_rank``-th block of the F gate rows followed by the same block
    of the F up rows (``[E, F, H]`` ungated: the row block), of ``fc2_weight`` ``[E, H, F]`` the
    ``etp_rank``-th column block; ``fc2_bias`` is not split.
    """
    experts = full[ep_rank * num_local : (ep_rank + 1) * num_local]
    if name == "fc1_weight":
        if gated:
            ffn = experts.shape[1] // 2
            block = ffn // etp_size
            gate = experts[:, etp_rank * block : (etp_rank + 1) * block]
            up = experts[:, ffn + etp_rank * block : ffn + (etp_rank + 1) * block]
            return torch.cat([gate, up], dim=1)
        block = experts.shape[1] // etp_size
        return experts[:, etp_rank * block : (etp_rank + 1) * block]
    if name == "fc2_weight":
        block = experts.shape[2] // etp_size
        return experts[:, :, etp_rank * block : (etp_rank + 1) * block]
    return experts


def expected_dispatch_stats(
    dispatcher: str, maps: list[Tensor], rank: int, dims, hidden: int, elem_bytes: int = 4
) -> dict[str, int]:
    """`DispatchStats` of one forward of ``dispatcher`` on global rank ``rank``.

    ``maps``: the routing map every global rank dispatches (``[T_r, E]``); ``dims``: the
    `ParallelDims`; rows and probabilities of ``elem_bytes`` per element. What a row is:

    * ``alltoall``: one per (token, expert) pair, with its probability;
    * ``flex``: one per (token, EP rank holding one of its experts), with the probability of each
      of its experts there; beside it a bitmask of ``ceil(E_local / 8)`` bytes per row (none with
      one local expert), counted as index bytes;
    * both: the EP all-to-all sends the rows for other EP ranks, the ETP all-gather every received
      row to each ETP peer; the combine sends each received row back (after the ETP reduce-scatter);
    * ``allgather``: every token with its probs (fp32) and routing-map row (1 byte) over all E
      experts, to every other rank of the ETP x EP group; the reduce-scatter the mirror image.
    """
    num_experts = maps[0].shape[1]
    nle = num_experts // dims.ep
    hidden_bytes = hidden * elem_bytes
    if dispatcher == "allgather":
        group_tokens = [maps[r].shape[0] for r in dims.group_of("etp_ep", rank)]
        mine, others = maps[rank].shape[0], sum(group_tokens) - maps[rank].shape[0]
        peers = len(group_tokens) - 1
        row_bytes = hidden_bytes + num_experts * (elem_bytes + 1)
        return {
            "rows_sent": mine * peers, "dispatch_bytes": mine * peers * row_bytes,
            "dispatch_bytes_received": others * row_bytes, "combine_bytes": others * hidden_bytes,
            "combine_bytes_received": mine * peers * hidden_bytes,
            "dispatch_index_bytes": 0, "dispatch_index_bytes_received": 0,
        }

    def block(source: int, dest_ep: int) -> Tensor:
        return maps[source][:, dest_ep * nle : (dest_ep + 1) * nle]

    def rows(source: int, dest_ep: int) -> int:
        picked = block(source, dest_ep)
        return int(picked.any(1).sum()) if dispatcher == "flex" else int(picked.sum())

    def assignments(source: int, dest_ep: int) -> int:
        return int(block(source, dest_ep).sum())

    def received(r: int, count) -> int:
        """What the EP all-to-all brings to global rank r: rows (or assignments) for its experts."""
        return sum(count(s, dims.coords(r).ep) for s in dims.group_of("ep", r))

    me, peers = dims.coords(rank).ep, dims.etp - 1
    etp_peers = [r for r in dims.group_of("etp", rank) if r != rank]
    totals = {}
    for name, count in (("rows", rows), ("assign", assignments)):
        remote = sum(count(rank, d) for d in range(dims.ep) if d != me)
        mine = received(rank, count)
        totals[name] = (
            remote,
            remote + mine * peers,  # sent: remote rows, then this rank's received rows to each ETP peer
            mine - count(rank, me) + sum(received(r, count) for r in etp_peers),  # received
        )
    remote_rows, out_rows, in_rows = totals["rows"]
    _, out_assign, in_assign = totals["assign"]
    mask_bytes = math.ceil(nle / 8) if dispatcher == "flex" and nle > 1 else 0
    return {
        "rows_sent": remote_rows,
        "dispatch_bytes": out_rows * hidden_bytes + out_assign * elem_bytes,
        "dispatch_bytes_received": in_rows * hidden_bytes + in_assign * elem_bytes,
        "combine_bytes": in_rows * hidden_bytes,
        "combine_bytes_received": out_rows * hidden_bytes,
        "dispatch_index_bytes": out_rows * mask_bytes,
        "dispatch_index_bytes_received": in_rows * mask_bytes,
    }
