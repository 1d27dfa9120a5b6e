"""`ExpertLoadMetric`: expert load, token dropping, router entropy and the logged MoE losses.

A torchmetrics ``Metric`` over the statistics every ``TopKRouter`` records once per training
micro-batch (``router.read_metric_stats``, defined in :mod:`lightning_moe.layers.router_metrics`),
its coefficient-free loss values (``logged_loss_sums`` / ``logged_loss_counts``) and, under
expert parallelism, the bytes its dispatcher sent (``dispatcher.stats``). Every state is one
device tensor stacked over the layers, so an update is a few in-place additions (no host
synchronisation) and ``compute()`` synchronises each state once for all layers.

Which ranks to sum over (``process_group``). Under MoE parallel folding every rank of a pipeline
stage (the ``tp_dp_cp`` group of a :class:`~lightning_moe.parallel.ParallelContext`, the whole
world without pipeline parallelism) routes tokens of its own through the same layers:
data-parallel ranks hold different samples, context-parallel ranks different slices of each
sequence (``MoEStrategy`` leaves that slicing to the model, as documented there), and the
tensor-parallel ranks of a model sharded by ``apply_tensor_parallel`` different slices of the
sequence (sequence parallelism feeds each MoE layer its rank's slice). Expert
parallelism moves tokens only after the router has counted them, so each token is counted once,
by the rank that routed it, and the sum over those ranks equals the counts of one device running
the whole global batch. The same holds for data parallelism without ``MoEStrategy`` (the default
world group). (``MoEStrategy`` refuses TP > 1 for MoE layers outside the reference model's
tensor-parallel plan, which would route the same tokens on every TP rank.)

Under pipeline parallelism a rank holds only its stages' layers. Every rank then keeps a row for
every layer of the model (numbered as the whole model numbers them:
:func:`~lightning_moe.metrics.layer_rows.global_layer_rows`) and fills only its own; with
``pipeline_group`` (the ``pp`` group) ``compute()`` first sums the rows over it (the other
stages' rows are zero on this rank, so the sum is exact and the loss counts' maximum is the owning
stage's), then over ``process_group`` as above: every rank gets the report of the whole model.

Loss values follow Megatron-LM's tracker (``save_to_aux_losses_tracker``,
``reduce_aux_losses_tracker_across_ranks`` and ``track_moe_metrics`` in
``megatron/core/transformer/moe/moe_utils.py``): per rank the mean over the recorded
micro-batches; summed over the loss's reduce group and averaged over data parallelism. A rank's
``load_balancing_loss`` / ``seq_load_balancing_loss`` is its share of its TP x CP group's loss,
so the value is ``sum over ranks / DP``; ``global_load_balancing_loss`` shares add up over
TP x DP x CP, so it is ``sum over ranks``; ``z_loss`` is each rank's own mean, so it is
``sum over ranks / (TP * CP * DP)`` (upstream records ``z / (TP*CP)`` summed over TP x CP and then
averages over DP: the same number). The overall value is the mean over the layers, as upstream.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_max
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_moe.layers.moe import MoELayer
from lightning_moe.layers.router import LOGGED_LOSS_NAMES

__all__ = ["ExpertLoadMetric", "flatten_for_logging", "moe_layers", "read_layer_stats"]

# Divisor of the summed per-rank loss values, by loss name: "dp" (aux, seq aux), "one" (global
# aux) or "world" (z-loss), see the module docstring.
_LOSS_DIVISOR_KIND = {
    "load_balancing_loss": "dp",
    "seq_load_balancing_loss": "dp",
    "global_load_balancing_loss": "one",
    "z_loss": "world",
}


def read_layer_stats(layer: MoELayer, reset: bool = True) -> dict:
    """Everything `ExpertLoadMetric.update` takes from one `MoELayer`, as keyword arguments.

    Device tensors except the byte counts (host integers the dispatcher already holds); no
    synchronisation. With ``reset`` the router's metric statistics and logged-loss buffers and the
    dispatcher's counters are zeroed: the caller becomes their consumer (``router.logged_losses()``
    then sees only what was recorded after this read).
    """
    router = layer.router
    loss_sums, loss_counts = router.logged_loss_sums.clone(), router.logged_loss_counts.clone()
    if reset:
        router.logged_loss_sums.zero_()
        router.logged_loss_counts.zero_()
    out = {"stats": router.read_metric_stats(reset=reset), "loss_sums": loss_sums, "loss_counts": loss_counts}
    dispatch_stats = getattr(layer.dispatcher, "stats", None)
    if dispatch_stats is not None:
        snapshot = dispatch_stats.reset() if reset else dispatch_stats
        out["dispatch_bytes"], out["combine_bytes"] = snapshot.dispatch_bytes, snapshot.combine_bytes
    return out


class ExpertLoadMetric(Metric):
    """Per-layer expert load statistics of an MoE model, summed over micro-batches and ranks.

    Args:
        num_layers: MoE layers of the model (rows of every state).
        num_experts: experts per layer (the global count, not this rank's share).
        process_group: ranks whose tokens are summed; None = the default (world) group. Under
            ``MoEStrategy`` pass ``ctx.group("tp_dp_cp")`` (module docstring explains why).
        data_parallel_size: dense DP size (the divisor of the load-balancing losses).
        tp_cp_size: TP x CP size; ``tp_cp_size * data_parallel_size`` must be the size of
            ``process_group`` (the divisor of the z-loss).
        pipeline_group: under pipeline parallelism, the ``pp`` group: ``num_layers`` is then the
            whole model's count, each rank updates the rows of its stages' layers, and
            ``compute()`` sums the rows over this group before ``process_group`` (module
            docstring). None (default): no pipeline stages.
        kwargs: torchmetrics ``Metric`` options (``sync_on_compute``, ``dist_sync_fn``, ...).

    ``update(layer, stats=None, loss_sums=None, loss_counts=None, dispatch_bytes=0, combine_bytes=0)``
    adds one layer's statistics (the output of :func:`read_layer_stats`); ``compute()`` returns a
    dict of device tensors, ``L`` layers, ``E`` experts:

    * ``tokens_per_expert`` int64 ``[L, E]`` (kept assignments of valid tokens) and
      ``tokens_per_expert_total`` ``[E]`` (summed over layers);
    * ``imbalance`` ``[L]``: ``max_e / mean_e`` of a layer's counts (1 = perfectly balanced; at
      most ``E / K``, every token on the same ``K`` experts; NaN without tokens), with
      ``imbalance_max`` and ``imbalance_mean`` over the layers;
    * ``dropped_fraction`` ``[L]`` and ``dropped_fraction_total``: assignments dropped by the
      capacity limit over assignments chosen;
    * ``router_entropy`` ``[L]`` and ``router_entropy_mean``: mean entropy (nats) of the normalised
      routing scores per valid token, in ``[0, ln E]``;
    * ``tokens`` int64 ``[L]``: valid tokens routed;
    * ``dispatch_bytes`` / ``combine_bytes`` int64 ``[L]`` and their ``_total``: bytes sent to
      other ranks by all ranks together (zero on one device);
    * for each loss recorded in at least one layer, ``<name>`` ``[L]`` (NaN where a layer did not
      record it) and ``<name>_mean`` over the layers that did (names in ``LOGGED_LOSS_NAMES``).
    """

    full_state_update = False
    higher_is_better = None
    is_differentiable = False

    tokens_per_expert: Tensor
    dropped: Tensor
    routed: Tensor
    tokens: Tensor
    entropy_sum: Tensor
    dispatch_bytes: Tensor
    combine_bytes: Tensor
    loss_sums: Tensor
    loss_counts: Tensor

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        process_group=None,
        data_parallel_size: int = 1,
        tp_cp_size: int = 1,
        pipeline_group: dist.ProcessGroup | None = None,
        **kwargs,
    ) -> None:
        super().__init__(process_group=process_group, **kwargs)
        self.pipeline_group = pipeline_group
        if num_layers < 1 or num_experts < 1 or data_parallel_size < 1 or tp_cp_size < 1:
            raise ValueError(
                f"ExpertLoadMetric needs positive sizes, got num_layers={num_layers}, num_experts="
                f"{num_experts}, data_parallel_size={data_parallel_size}, tp_cp_size={tp_cp_size}."
            )
        self.num_layers, self.num_experts = num_layers, num_experts
        self.data_parallel_size, self.tp_cp_size = data_parallel_size, tp_cp_size
        num_losses = len(LOGGED_LOSS_NAMES)
        int_states = {
            "tokens_per_expert": (num_layers, num_experts), "dropped": (num_layers,), "routed": (num_layers,),
            "tokens": (num_layers,), "dispatch_bytes": (num_layers,), "combine_bytes": (num_layers,),
        }
        for name, shape in int_states.items():
            self.add_state(name, torch.zeros(shape, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("entropy_sum", torch.zeros(num_layers, dtype=torch.float32), dist_reduce_fx="sum")
        self.add_state("loss_sums", torch.zeros(num_layers, num_losses, dtype=torch.float32), dist_reduce_fx="sum")
        # Every rank records the same number of micro-batches per loss, so the sum of the ranks'
        # sums divided by the (common) count is the sum of the ranks' means.
        self.add_state("loss_counts", torch.zeros(num_layers, num_losses, dtype=torch.int64), dist_reduce_fx="max")

    def update(
        self,
        layer: int,
        stats: Mapping[str, Tensor] | None = None,
        loss_sums: Tensor | None = None,
        loss_counts: Tensor | None = None,
        dispatch_bytes: int = 0,
        combine_bytes: int = 0,
    ) -> None:
        """Add layer ``layer``'s statistics; ``stats=None`` adds no token statistics (duplicated tokens)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} is out of range for a metric of {self.num_layers} layers.")
        if stats is not None:
            counts = stats["tokens_per_expert"]
            if counts.shape != (self.num_experts,):
                raise ValueError(
                    f"tokens_per_expert of layer {layer} has shape {tuple(counts.shape)}, expected "
                    f"({self.num_experts},): pass the global per-expert counts of the router."
                )
            self.tokens_per_expert[layer] += counts
            self.dropped[layer] += stats["dropped"]
            self.routed[layer] += stats["routed"]
            self.tokens[layer] += stats["tokens"]
            self.entropy_sum[layer] += stats["entropy_sum"]
        if loss_sums is not None and loss_counts is not None:
            self.loss_sums[layer] += loss_sums
            self.loss_counts[layer] += loss_counts
        # Python integers: a kernel with a scalar argument, no host-to-device copy.
        self.dispatch_bytes[layer] += int(dispatch_bytes)
        self.combine_bytes[layer] += int(combine_bytes)

    def _wrap_compute(self, compute: Callable) -> Callable:
        """torchmetrics' compute wrapper (sync, cache), then the documented shapes restored.

        torchmetrics squeezes every one-element tensor of the result (``[1] -> []``), which turns
        the ``[L]`` results of a one-layer metric and the ``[E]`` / ``[L, E]`` ones of a
        one-expert metric into scalars. Overriding this hook (as torchmetrics'
        ``CompositionalMetric`` does) rather than wrapping ``compute`` once in ``__init__`` keeps
        the fix after a copy or unpickling, which wrap ``compute`` again.
        """
        wrapped = super()._wrap_compute(compute)

        @functools.wraps(wrapped)
        def with_shapes(*args, **kwargs) -> dict[str, Tensor]:
            return self._restore_shapes(wrapped(*args, **kwargs))

        return with_shapes

    def _sync_dist(self, dist_sync_fn: Callable = gather_all_tensors, process_group=None) -> None:
        """torchmetrics' sync over ``process_group``, once the other pipeline stages' rows are summed in.

        One in-place all-reduce per state over ``pipeline_group`` (sum, the loss counts' max), in
        the states' fixed order on every rank. torchmetrics calls this hook after caching the local
        states, so ``unsync`` still restores this rank's own rows after ``compute()``.
        """
        if self.pipeline_group is not None:
            for name, reduction in self._reductions.items():  # add_state's "max" / "sum"
                op = dist.ReduceOp.MAX if reduction is dim_zero_max else dist.ReduceOp.SUM
                dist.all_reduce(getattr(self, name), op=op, group=self.pipeline_group)
        super()._sync_dist(dist_sync_fn, process_group=process_group)

    def _restore_shapes(self, result: dict[str, Tensor]) -> dict[str, Tensor]:
        layers, experts = self.num_layers, self.num_experts
        shapes = {"tokens_per_expert": (layers, experts), "tokens_per_expert_total": (experts,)}
        per_layer = ("imbalance", "dropped_fraction", "router_entropy", "tokens", "dispatch_bytes", "combine_bytes",
                     *LOGGED_LOSS_NAMES)
        shapes.update(dict.fromkeys(per_layer, (layers,)))
        return {key: value.reshape(shapes[key]) if key in shapes else value for key, value in result.items()}

    def _loss_divisors(self) -> list[float]:
        sizes = {"dp": self.data_parallel_size, "one": 1, "world": self.data_parallel_size * self.tp_cp_size}
        return [float(sizes[_LOSS_DIVISOR_KIND[name]]) for name in LOGGED_LOSS_NAMES]

    def compute(self) -> dict[str, Tensor]:
        """The statistics of everything added since the last reset (see the class docstring)."""
        counts = self.tokens_per_expert
        mean_load = counts.sum(dim=1, dtype=torch.float64) / self.num_experts
        imbalance = (counts.amax(dim=1).double() / mean_load).float()
        nan = torch.tensor(float("nan"), device=counts.device)
        out = {
            "tokens_per_expert": counts.clone(),
            "tokens_per_expert_total": counts.sum(dim=0),
            "imbalance": imbalance,
            "imbalance_max": imbalance.amax(),
            "imbalance_mean": imbalance.mean(),
            "dropped_fraction": self.dropped.double().div(self.routed).float(),
            "dropped_fraction_total": (self.dropped.sum().double() / self.routed.sum()).float(),
            "router_entropy": self.entropy_sum / self.tokens,
            "router_entropy_mean": self.entropy_sum.sum() / self.tokens.sum(),
            "tokens": self.tokens.clone(),
            "dispatch_bytes": self.dispatch_bytes.clone(),
            "dispatch_bytes_total": self.dispatch_bytes.sum(),
            "combine_bytes": self.combine_bytes.clone(),
            "combine_bytes_total": self.combine_bytes.sum(),
        }
        divisors = torch.tensor(self._loss_divisors(), device=self.loss_sums.device)
        recorded = self.loss_counts > 0
        means = torch.where(recorded, self.loss_sums / self.loss_counts.clamp_min(1) / divisors, nan)
        any_layer = recorded.any(dim=0).tolist()  # one host read, at compute time only
        for index, name in enumerate(LOGGED_LOSS_NAMES):
            if any_layer[index]:
                out[name] = means[:, index]
                out[f"{name}_mean"] = means[:, index].nanmean()
        return out


def flatten_for_logging(
    result: Mapping[str, Tensor], prefix: str = "moe/", per_layer: bool = True, expert_counts: bool = True
) -> dict[str, float]:
    """Scalar names and values of a `ExpertLoadMetric.compute` result, for a logger.

    Overall: ``{prefix}imbalance_max``, ``imbalance_mean``, ``dropped_fraction``, ``router_entropy``,
    ``tokens``, ``dispatch_bytes``, ``combine_bytes``, each recorded loss by its Megatron name
    (``load_balancing_loss``, ``z_loss``, ...: the mean over layers) and, with ``expert_counts``,
    ``tokens_per_expert/<e>`` summed over layers. With ``per_layer`` the same per layer under
    ``{prefix}layer_<i>/`` (``imbalance`` instead of max/mean; ``tokens_per_expert/<e>`` with
    ``expert_counts``). Reads the tensors to the host (call it only when logging).
    """
    host = {key: value.detach().cpu() for key, value in result.items()}
    losses = [name for name in LOGGED_LOSS_NAMES if name in host]
    out = {
        f"{prefix}imbalance_max": host["imbalance_max"].item(),
        f"{prefix}imbalance_mean": host["imbalance_mean"].item(),
        f"{prefix}dropped_fraction": host["dropped_fraction_total"].item(),
        f"{prefix}router_entropy": host["router_entropy_mean"].item(),
        f"{prefix}tokens": float(host["tokens"].sum().item()),
        f"{prefix}dispatch_bytes": float(host["dispatch_bytes_total"].item()),
        f"{prefix}combine_bytes": float(host["combine_bytes_total"].item()),
    }
    out.update({f"{prefix}{name}": host[f"{name}_mean"].item() for name in losses})
    if expert_counts:
        totals = host["tokens_per_expert_total"].tolist()
        out.update({f"{prefix}tokens_per_expert/{e}": float(c) for e, c in enumerate(totals)})
    if per_layer:
        for i in range(host["imbalance"].shape[0]):
            layer = f"{prefix}layer_{i}/"
            out[f"{layer}imbalance"] = host["imbalance"][i].item()
            out[f"{layer}dropped_fraction"] = host["dropped_fraction"][i].item()
            out[f"{layer}router_entropy"] = host["router_entropy"][i].item()
            out[f"{layer}dispatch_bytes"] = float(host["dispatch_bytes"][i].item())
            out.update({f"{layer}{name}": host[name][i].item() for name in losses})
            if expert_counts:
                counts = host["tokens_per_expert"][i].tolist()
                out.update({f"{layer}tokens_per_expert/{e}": float(c) for e, c in enumerate(counts)})
    return out


def moe_layers(module: nn.Module) -> list[MoELayer]:
    """Every `MoELayer` inside ``module``, in ``modules()`` order (the metric's layer order)."""
    return [m for m in module.modules() if isinstance(m, MoELayer)]
