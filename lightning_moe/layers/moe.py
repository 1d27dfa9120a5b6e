"""`MoELayer`: router, (optional) shared expert and routed experts, on one device.

Forward order follows Megatron Core (docs/numerics.md §1): the shared expert runs on the
input, the router gives sparse ``probs [T, E]`` and a ``routing_map [T, E]``, the routed tokens
go through their experts (probs multiply each expert's activation output, before fc2), the
expert outputs are summed per token, and the shared output is added.

Parallelism is applied afterwards (docs/architecture.md §2): ``lightning_moe.parallel`` replaces
``self.dispatcher`` (a :class:`~lightning_moe.layers.dispatch.LocalDispatcher`, which fuses the
permutation into the expert kernel) and sets the router's reductions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.dispatch import LocalDispatcher, TokenDispatcher
from lightning_moe.layers.experts import GroupedExperts, expert_generator
from lightning_moe.layers.permute import pad_routing_map
from lightning_moe.layers.router import TopKRouter
from lightning_moe.layers.shared_expert import SharedExpertMLP
from lightning_moe.layers.weight_init import reset_adapters

__all__ = ["MoELayer"]

# Generator streams of the non-expert weights; experts use their global index (>= 0).
_ROUTER_STREAM = -1
_SHARED_EXPERT_STREAM = -2


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward layer with Megatron Core numerics.

    ``forward(hidden, padding_mask=None)`` takes ``[B, S, H]`` (batch first) or ``[T, H]`` (flat
    tokens, one sequence for the sequence-level aux loss) and returns the same shape.
    ``padding_mask`` has shape ``hidden.shape[:-1]``, True = padding: padded tokens are routed
    and computed but excluded from the load-balancing losses, z-loss and expert-bias counts.
    Auxiliary losses reach the gradients through an autograd scaler on the router outputs, so
    the training loss needs no change; their values are kept by ``router.logged_losses()``.
    Zero tokens (``[0, H]``, ``[0, S, H]`` or ``[B, 0, H]``: an expert-parallel rank or a
    micro-batch without any) give an empty output, zero losses (logged as 0) and zero gradients.

    State dict (public format, docs/architecture.md §6): ``router.weight`` ``[E, H]``,
    ``router.expert_bias`` ``[E]`` (with expert bias), ``experts.fc1_weight`` ``[E, 2, F, H]``
    for gated activations (index 0 the gate rows, 1 the up rows; older checkpoints' ``[E, 2F, H]``
    loads too) or ``[E, F, H]``, ``experts.fc2_weight``
    ``[E, H, F]``, optional ``experts.fc2_bias`` ``[E, H]``, ``experts.fc1_bias`` ``[E, 2, F]`` (gated;
    else ``[E, F]``) and ``router.bias`` ``[E]``, ``shared_expert.fc1.weight``,
    ``shared_expert.fc2.weight`` and ``shared_expert.gate.weight``.

    Initialisation draws one seed from the global RNG when the layer is built; every expert's
    weights then come from (that seed, its global index), so the same model built at any expert-
    parallel size, or on the meta device and materialised with :meth:`reset_parameters`, holds
    the same weights.
    """

    def __init__(
        self,
        config: MoEConfig,
        expert_kernel: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        # Explicitly on the CPU generator so that building under a meta-device context works.
        self.init_seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
        self.router = TopKRouter(config)
        self.experts = GroupedExperts(
            config.num_experts, config.hidden_size, config.ffn_hidden_size, config.activation,
            fc2_bias=config.fc2_bias, kernel=expert_kernel, device=device, dtype=dtype,
            fc1_bias=config.fc1_bias, activation_params=config.activation_params,
        )
        self.shared_expert = None
        if config.shared_expert_ffn_hidden_size:
            self.shared_expert = SharedExpertMLP(
                config.hidden_size, config.shared_expert_ffn_hidden_size, config.activation,
                gate=config.shared_expert_gate, activation_params=config.activation_params,
            )
        self.dispatcher: TokenDispatcher = LocalDispatcher(config)
        """Moves routed tokens to the experts and back; ``lightning_moe.parallel`` swaps it."""
        if device is not None or dtype is not None:
            self.router.to(device=device)
            if self.shared_expert is not None:
                self.shared_expert.to(device=device, dtype=dtype)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)draw every weight from the layer's seed; a no-op for meta tensors' values."""
        if self.experts.fc1_weight.is_meta:
            return
        std = self.config.init_std
        self.router.reset_parameters(expert_generator(self.init_seed, _ROUTER_STREAM))
        self.experts.reset_parameters(self.init_seed, std)
        if self.shared_expert is not None:
            self.shared_expert.reset_parameters(expert_generator(self.init_seed, _SHARED_EXPERT_STREAM), std)
        if self.router.expert_bias is not None:
            self.router.expert_bias.zero_()
        reset_adapters(self)

    def forward(self, hidden: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """Route every token to its experts and return the combined output, shaped like ``hidden``."""
        if hidden.dim() not in (2, 3) or hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"MoELayer expects hidden of shape [B, S, {self.config.hidden_size}] or "
                f"[T, {self.config.hidden_size}], got {tuple(hidden.shape)}."
            )
        if padding_mask is not None and padding_mask.shape != hidden.shape[:-1]:
            raise ValueError(
                f"padding_mask must have shape {tuple(hidden.shape[:-1])} (hidden.shape[:-1]), "
                f"got {tuple(padding_mask.shape)}."
            )
        num_sequences = hidden.shape[0] if hidden.dim() == 3 else 1
        tokens = hidden.reshape(-1, hidden.shape[-1])
        mask = None if padding_mask is None else padding_mask.reshape(-1)

        shared_out = self.shared_expert(tokens) if self.shared_expert is not None else None
        probs, routing_map = self.router(tokens, mask, num_sequences=num_sequences)
        if self.config.router_padding_alignment is not None:
            routing_map = pad_routing_map(routing_map, self.config.router_padding_alignment)
        rows, tokens_per_expert, row_probs, metadata = self.dispatcher.dispatch(tokens, probs, routing_map)
        out = self.dispatcher.combine(self.run_experts(rows, tokens_per_expert, row_probs, metadata), metadata)
        if shared_out is not None:
            out = out + shared_out
        return out.view(hidden.shape)

    def run_experts(
        self, rows: Tensor, tokens_per_expert: list[int] | Tensor, row_probs: Tensor, metadata: Any
    ) -> Tensor:
        """The routed experts on what the dispatcher's ``dispatch`` returned; the input of its ``combine``.

        Expert modules that predate the sync-free protocol (:mod:`lightning_moe.layers.dispatch`)
        get host counts and no permutation flag; ``GroupedExperts`` declares both. The CUDA-graph
        scopes' staged forward calls this too, so both hand the experts the same arguments.
        """
        row_index = metadata.row_index
        if isinstance(tokens_per_expert, Tensor) and not getattr(self.experts, "accepts_device_counts", False):
            tokens_per_expert = tokens_per_expert.tolist()
        flags = {}
        permutation = row_index is not None and getattr(metadata, "row_index_is_permutation", False)
        if permutation and getattr(self.experts, "accepts_permutation_flag", False):
            flags["row_index_is_permutation"] = True
        return self.experts(
            rows, tokens_per_expert, row_probs, row_index=row_index,
            num_out_rows=None if row_index is None else rows.shape[0], **flags,
        )
