"""`TopKRouter`: the gate of an MoE layer, with Megatron Core's losses, capacity and expert bias.

Reference: docs/numerics.md §2-§7. The router is single-device code: statistics that Megatron
sums over process groups are summed through the closures of a :class:`RouterReduction`, which
the parallel package sets on ``router.reduction`` (the default is one device). The pure routing
functions live in ``routing.py`` and are re-exported here.

Once-per-micro-batch side effects (attaching and logging the losses, expert-bias token counts,
global aux-loss statistics, load-balance metric statistics) happen only when
``self.training and torch.is_grad_enabled()``, so a forward run under ``no_grad`` and then
recomputed with grad (reentrant activation checkpointing) counts once (docs/architecture.md §4). A plain
non-reentrant ``torch.utils.checkpoint`` recomputes with grad enabled and would count twice;
``lightning_moe.memory``'s recompute restores the buffers around its recomputation instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_moe.layers import losses
from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.expert_kernels import autocast_disabled
from lightning_moe.layers.router_metrics import METRIC_STAT_NAMES, kept_assignments, routing_metric_stats
from lightning_moe.layers.routing import (
    apply_input_jitter,
    apply_token_dropping,
    expert_capacity,
    group_limited_topk,
    random_logits_straight_through,
    topk_routing,
    update_expert_bias,
)
from lightning_moe.layers.weight_init import write_full

__all__ = [
    "LOGGED_LOSS_NAMES",
    "RouterReduction",
    "TopKRouter",
    "apply_input_jitter",
    "apply_token_dropping",
    "expert_capacity",
    "group_limited_topk",
    "random_logits_straight_through",
    "topk_routing",
    "update_expert_bias",
]

LOGGED_LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")
"""Names under which Megatron logs the coefficient-free losses; also the keys of ``logged_losses``."""

# Read-only mappings: no module-level mutable state.
_LOGGED_NAME_BY_BALANCING_TYPE = MappingProxyType(
    {
        "aux_loss": "load_balancing_loss",
        "seq_aux_loss": "seq_load_balancing_loss",
        "global_aux_loss": "global_load_balancing_loss",
    }
)
_ROUTER_DTYPES = MappingProxyType({"fp32": torch.float32, "fp64": torch.float64, None: None})


def _identity(tensor: Tensor) -> Tensor:
    return tensor


@dataclass(frozen=True)
class RouterReduction:
    """How a router's statistics are summed across ranks; the defaults describe one device.

    Each ``sum_*`` closure takes a tensor of counts (no autograd) and returns its sum over the
    group, e.g. ``lambda t: (dist.all_reduce(t, group=g), t)[1]``; it may reduce in place.
    """

    sum_tp_cp: Callable[[Tensor], Tensor] = _identity
    """Sum over the tensor x context parallel group (aux_loss and seq_aux_loss counts)."""
    tp_cp_size: int = 1
    """Size of that group (tokens of one micro-batch of one DP rank are spread over it)."""
    sum_tp_dp_cp: Callable[[Tensor], Tensor] = _identity
    """Sum over the tensor x data x context parallel group (global_aux_loss counts)."""
    tp_dp_cp_size: int = 1
    """Size of that group."""

    def __post_init__(self) -> None:
        if self.tp_cp_size < 1 or self.tp_dp_cp_size < 1 or self.tp_dp_cp_size % self.tp_cp_size:
            raise ValueError(
                f"RouterReduction needs tp_cp_size >= 1 dividing tp_dp_cp_size, got tp_cp_size="
                f"{self.tp_cp_size}, tp_dp_cp_size={self.tp_dp_cp_size}."
            )

    @property
    def dp_size(self) -> int:
        """Data-parallel size ``tp_dp_cp_size / tp_cp_size``."""
        return self.tp_dp_cp_size // self.tp_cp_size


class TopKRouter(nn.Module):
    """Top-k router with Megatron Core numerics (``megatron/core/transformer/moe/router.py``).

    State dict: ``weight`` ``[E, H]`` (``nn.Linear`` convention), with ``config.router_bias`` the
    logits' ``bias`` ``[E]``, and, with ``config.expert_bias``,
    the fp32 buffer ``expert_bias`` ``[E]``. Non-persistent buffers, read and reset by their
    consumers: ``local_tokens_per_expert`` (int64 ``[E]``, assignments of valid tokens per expert
    chosen by top-k and kept by the capacity limit since the last reset; unlike upstream, filler
    rows of ``pad_to_capacity`` are not counted; the expert-bias update sums it over TP x DP x CP,
    applies :func:`update_expert_bias` and zeroes it), ``global_tokens_per_expert`` (int64 ``[E]``) and
    ``global_aux_loss_steps`` (int64 scalar) of the global aux loss (``reset_global_aux_loss_state``
    after every global batch), ``logged_loss_sums`` / ``logged_loss_counts`` (read with
    :meth:`logged_losses`), and the load-balance monitoring statistics ``metric_tokens_per_expert``
    (int64 ``[E]``), ``metric_dropped``, ``metric_routed``, ``metric_tokens`` (int64) and
    ``metric_entropy_sum`` (fp32), defined in :mod:`lightning_moe.layers.router_metrics` and read
    with :meth:`read_metric_stats`. The metric counts are separate from ``local_tokens_per_expert``
    (which the expert-bias update consumes) so a monitor never disturbs training.

    Attributes set by the strategy: ``reduction`` (a :class:`RouterReduction`) and
    ``aux_loss_scale`` (float or 0-dim tensor read when backward runs, the gradient scale of the
    attached losses: GradScaler scale x ``CP / accumulation``, see
    :mod:`lightning_moe.layers.loss_scale`; None until something sets it, then 1.0 with a warning).
    """

    _FP32_BUFFERS = ("expert_bias", "logged_loss_sums", "metric_entropy_sum")

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        num_experts = config.num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32)) if config.router_bias else None
        """With ``config.router_bias``: ``[E]`` added to the logits (GPT-OSS), else None."""
        bias = torch.zeros(num_experts, dtype=torch.float32) if config.expert_bias else None
        self.register_buffer("expert_bias", bias, persistent=True)
        int_zeros = torch.zeros(num_experts, dtype=torch.int64)
        self.register_buffer("local_tokens_per_expert", int_zeros.clone(), persistent=False)
        self.register_buffer("global_tokens_per_expert", int_zeros.clone(), persistent=False)
        self.register_buffer("global_aux_loss_steps", torch.zeros((), dtype=torch.int64), persistent=False)
        num_names = len(LOGGED_LOSS_NAMES)
        self.register_buffer(
            "logged_loss_sums", torch.zeros(num_names, dtype=torch.float32), persistent=False
        )
        self.register_buffer(
            "logged_loss_counts", torch.zeros(num_names, dtype=torch.int64), persistent=False
        )
        for name in METRIC_STAT_NAMES:
            shape = (num_experts,) if name == "tokens_per_expert" else ()
            dtype = torch.float32 if name == "entropy_sum" else torch.int64
            self.register_buffer(f"metric_{name}", torch.zeros(shape, dtype=dtype), persistent=False)
        self.reduction = RouterReduction()
        self.aux_loss_scale: float | Tensor | None = None  # None: unmanaged (1.0, warns once; see loss_scale)
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Draw ``weight`` from N(0, ``config.init_std``) using ``generator`` (default: global RNG).

        The values are drawn in fp32 on the generator's device and copied into the weight, so
        they do not depend on the weight's device or dtype (the MoE layer passes a generator
        seeded per layer for identical weights at every parallel layout). The router bias, the expert bias and
        all statistics buffers are zeroed too, so a router built on the meta device and
        materialised with ``to_empty`` is fully initialised by this call.
        """
        if self.weight.is_meta:
            # Built on the meta device (as every strategy builds a model): there is nothing to write
            # yet, and materialisation calls this again. Drawing here would fill a real CPU tensor
            # per layer for nothing (about 7 MB and 20 ms for each of DeepSeek-V3's 58 routers).
            return
        device = generator.device if generator is not None else torch.device("cpu")
        values = torch.empty(self.weight.shape, dtype=torch.float32, device=device)
        values.normal_(0.0, self.config.init_std, generator=generator)
        with torch.no_grad():
            write_full(self.weight, values)
            if self.bias is not None:
                self.bias.zero_()
            for buffer in self.buffers(recurse=False):
                buffer.zero_()

    def _apply(self, fn, recurse=True):
        # Upstream bug #1482: a model-wide .half()/.to(bfloat16) must not round the expert bias
        # (updates of 1e-3 vanish in bf16) or the logged loss sums. Keep the fp32 originals and
        # move them to the new device only.
        fp32_originals = {
            name: self._buffers[name] for name in self._FP32_BUFFERS if self._buffers[name] is not None
        }
        super()._apply(fn, recurse)
        for name, original in fp32_originals.items():
            converted = self._buffers[name]
            if converted.dtype != torch.float32:
                self._buffers[name] = original.to(device=converted.device)
        return self

    def reset_global_aux_loss_state(self) -> None:
        """Zero the global aux-loss running statistics; call after every global batch."""
        self.global_tokens_per_expert.zero_()
        self.global_aux_loss_steps.zero_()

    def logged_losses(self, reset: bool = True) -> dict[str, Tensor]:
        """Coefficient-free loss values, averaged over the micro-batches recorded since the last reset.

        Keys are those of :data:`LOGGED_LOSS_NAMES` that were recorded. Values are this rank's:
        for the load-balancing losses its share of the group's loss (sum over TP x CP, or over
        TP x DP x CP for the global one, to get the group's value, as Megatron's tracker does);
        for ``z_loss`` the local mean of ``logsumexp**2``. Megatron logs ``loss / coeff`` too.
        """
        counts = self.logged_loss_counts.tolist()
        means = {
            name: (self.logged_loss_sums[index] / counts[index]).detach().clone()
            for index, name in enumerate(LOGGED_LOSS_NAMES)
            if counts[index] > 0
        }
        if reset:
            self.logged_loss_sums.zero_()
            self.logged_loss_counts.zero_()
        return means

    def read_metric_stats(self, reset: bool = True) -> dict[str, Tensor]:
        """Load-balance statistics accumulated since the last reset, keyed by ``METRIC_STAT_NAMES``.

        Copies of the ``metric_*`` buffers (device tensors, no host synchronisation): ``tokens_per_expert``
        int64 ``[E]``, ``dropped``, ``routed``, ``tokens`` int64 and ``entropy_sum`` fp32 scalars,
        summed over the training micro-batches recorded (definitions in
        :mod:`lightning_moe.layers.router_metrics`). ``reset`` zeroes the buffers afterwards.
        """
        stats = {name: getattr(self, f"metric_{name}").clone() for name in METRIC_STAT_NAMES}
        if reset:
            for name in METRIC_STAT_NAMES:
                getattr(self, f"metric_{name}").zero_()
        return stats

    def _record(self, name: str, value: Tensor) -> None:
        index = LOGGED_LOSS_NAMES.index(name)
        self.logged_loss_sums[index] += value.detach().float()
        self.logged_loss_counts[index] += 1

    def _validate_inputs(self, hidden: Tensor, padding_mask: Tensor | None, num_sequences: int) -> int:
        """Check the inputs of :meth:`forward`; returns the number of sequences to route with."""
        if hidden.dim() != 2 or hidden.shape[1] != self.config.hidden_size:
            raise ValueError(
                f"TopKRouter expects hidden of shape [num_tokens, {self.config.hidden_size}], got "
                f"{tuple(hidden.shape)}; flatten [B, S, H] inputs to [B * S, H] (sequence-major)."
            )
        num_tokens = hidden.shape[0]
        if padding_mask is not None and (
            padding_mask.shape != (num_tokens,) or padding_mask.dtype != torch.bool
        ):
            raise ValueError(
                f"padding_mask must be a bool tensor of shape ({num_tokens},) (True = padding), got "
                f"{padding_mask.dtype} {tuple(padding_mask.shape)}."
            )
        if num_tokens == 0 and num_sequences == 0:
            # A [0, S, H] batch (an expert-parallel rank or micro-batch without samples) holds the
            # same tokens as one empty sequence; the sequence aux loss needs B >= 1 to split them.
            return 1
        if num_sequences < 1 or num_tokens % num_sequences:
            raise ValueError(
                f"num_sequences={num_sequences} must be >= 1 and divide the {num_tokens} tokens "
                "(tokens are ordered sequence-major: t = b * S_local + s)."
            )
        return num_sequences

    def forward(
        self, hidden: Tensor, padding_mask: Tensor | None = None, num_sequences: int = 1
    ) -> tuple[Tensor, Tensor]:
        """Route ``hidden`` ``[T, H]``; returns ``(probs [T, E], routing_map [T, E] bool)``.

        Tokens are ordered sequence-major (``t = b * S_local + s``, ``num_sequences = B``) for the
        sequence aux loss; ``padding_mask`` ``[T]`` (True = padding) removes tokens from the losses
        and counts, not from routing. Zero tokens (also as ``num_sequences=0``) give empty outputs,
        attached losses of 0 recorded as 0 (a rank's share of its group's loss is then 0, and
        every rank records the same number of micro-batches) and nothing counted. Order as upstream
        (docs/numerics.md §2): jitter (training), logits in the router dtype, forced balancing,
        z-loss on the logits, top-k routing, capacity (per this rank's ``T``), aux losses on the
        probs, expert-bias counts of the kept assignments.
        Padding the map to ``config.router_padding_alignment`` is done after this, by the MoE
        layer with ``permute.pad_routing_map`` (those filler rows are not counted here).

        Precision: everything from the gate GEMM on (scores, top-k, losses, capacity) runs in the
        router dtype with autocast turned off, as Megatron keeps gating out of autocast, so
        ``bf16-mixed`` routes exactly like fp32 training and the probs leave in the router dtype.
        With ``router_dtype=None`` the router dtype is ``hidden.dtype``, never the autocast dtype:
        fp32 activations under ``bf16-mixed`` route in fp32, bf16 activations (``bf16-true``, like
        a Megatron bf16 model) in bf16.
        """
        num_sequences = self._validate_inputs(hidden, padding_mask, num_sequences)
        with autocast_disabled(hidden.device):
            return self._route(hidden, padding_mask, num_sequences)

    def _route(
        self, hidden: Tensor, padding_mask: Tensor | None, num_sequences: int
    ) -> tuple[Tensor, Tensor]:
        config = self.config
        record = self.training and torch.is_grad_enabled()

        if self.training and config.input_jitter_eps is not None:
            hidden = apply_input_jitter(hidden, config.input_jitter_eps)
        router_dtype = _ROUTER_DTYPES[config.router_dtype] or hidden.dtype
        # Upcast both operands so the logits are computed, not just stored, in the router dtype.
        bias = None if self.bias is None else self.bias.to(router_dtype)
        logits = F.linear(hidden.to(router_dtype), self.weight.to(router_dtype), bias)
        if config.force_load_balancing:
            logits = random_logits_straight_through(logits)
        if record and config.z_loss_coeff is not None:
            logits = self._attach_z_loss(logits, padding_mask)

        probs, routing_map = topk_routing(
            logits,
            config.top_k,
            score_func=config.score_func,
            pre_softmax=config.pre_softmax,
            num_groups=config.num_groups,
            group_top_k=config.group_top_k,
            scaling_factor=config.topk_scaling_factor,
            expert_bias=self.expert_bias,
        )
        selected_map = routing_map
        if config.capacity_factor is not None:
            capacity = expert_capacity(
                logits.shape[0] * config.top_k, config.num_experts, config.capacity_factor
            )
            probs, routing_map = apply_token_dropping(
                probs, routing_map, capacity, config.drop_policy, config.pad_to_capacity
            )

        if record:
            probs = self._attach_load_balancing_losses(probs, logits, padding_mask, num_sequences)
            with torch.no_grad():
                # Only real assignments are load: pad_to_capacity fillers counted would give every
                # expert exactly `capacity` rows and freeze the expert bias (upstream counts them).
                counted = kept_assignments(selected_map, routing_map, padding_mask)
                self.local_tokens_per_expert += counted.sum(dim=0)
            stats = routing_metric_stats(
                logits, selected_map, routing_map, config.top_k, config.score_func, padding_mask
            )
            for name, value in stats.items():
                getattr(self, f"metric_{name}").add_(value)
        return probs, routing_map

    def _attach_z_loss(self, logits: Tensor, padding_mask: Tensor | None) -> Tensor:
        # The coefficient-free mean is what Megatron logs; the attached value is coeff / |TP x CP|
        # times it (docs/numerics.md §6), so the TP x CP ranks, whose weight grads are summed, add
        # up to one mean.
        mean_squared_logsumexp = losses.z_loss(logits, 1.0, padding_mask)
        self._record("z_loss", mean_squared_logsumexp)
        attached = mean_squared_logsumexp * (self.config.z_loss_coeff / self.reduction.tp_cp_size)
        return losses.attach_loss(logits, attached, self.aux_loss_scale)

    def _attach_load_balancing_losses(
        self, probs: Tensor, logits: Tensor, padding_mask: Tensor | None, num_sequences: int
    ) -> Tensor:
        coeffs = {kind: coeff for kind, coeff in self.config.aux_loss_coeffs.items() if coeff > 0}
        if not coeffs:
            return probs
        top_k, reduction = self.config.top_k, self.reduction
        with_padding = padding_mask is not None
        scores, aux_map = losses.aux_loss_scores(logits, top_k, self.config.score_func, padding_mask)
        # Attached in Megatron's order: aux_loss, seq_aux_loss, global_aux_loss.
        if "aux_loss" in coeffs:
            counts = reduction.sum_tp_cp(aux_map.sum(dim=0))
            loss = losses.aux_loss(
                scores, counts, top_k, coeffs["aux_loss"], reduction.tp_cp_size, with_padding
            )
            probs = self._attach_and_record(probs, "aux_loss", loss, loss, coeffs)
        if "seq_aux_loss" in coeffs:
            counts = reduction.sum_tp_cp(losses.tokens_per_sequence_and_expert(aux_map, num_sequences))
            loss = losses.seq_aux_loss(
                scores,
                counts,
                num_sequences,
                top_k,
                coeffs["seq_aux_loss"],
                reduction.tp_cp_size,
                with_padding,
            )
            probs = self._attach_and_record(probs, "seq_aux_loss", loss, loss, coeffs)
        if "global_aux_loss" in coeffs:
            step_counts = reduction.sum_tp_dp_cp(aux_map.sum(dim=0))
            self.global_tokens_per_expert += step_counts.to(self.global_tokens_per_expert.dtype)
            self.global_aux_loss_steps += 1
            mean_counts = self.global_tokens_per_expert.float() / self.global_aux_loss_steps
            loss = losses.global_aux_loss(
                scores,
                mean_counts,
                step_counts,
                top_k,
                coeffs["global_aux_loss"],
                reduction.tp_dp_cp_size,
                with_padding,
            )
            # Deliberate fix of Megatron issue #3672, see losses.global_aux_loss: after the DP
            # average of dense grads the gradient is that of the global-batch loss itself.
            probs = self._attach_and_record(probs, "global_aux_loss", loss * reduction.dp_size, loss, coeffs)
        return probs

    def _attach_and_record(
        self, probs: Tensor, kind: str, attached: Tensor, logged: Tensor, coeffs: dict[str, float]
    ) -> Tensor:
        self._record(_LOGGED_NAME_BY_BALANCING_TYPE[kind], logged / coeffs[kind])
        return losses.attach_loss(probs, attached, self.aux_loss_scale)

    def extra_repr(self) -> str:
        """Shape and routing settings, shown by ``print(model)``."""
        config = self.config
        return (
            f"hidden_size={config.hidden_size}, num_experts={config.num_experts}, top_k={config.top_k}, "
            f"score_func={config.score_func!r}, expert_bias={config.expert_bias}"
        )
