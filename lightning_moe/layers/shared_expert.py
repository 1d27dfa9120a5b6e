"""The shared expert: a dense MLP applied to every token next to the routed experts.

Megatron Core ``moe/shared_experts.py::SharedExpertMLP`` (docs/numerics.md §1): an MLP of width
``moe_shared_expert_intermediate_size`` without biases, whose output the MoE layer adds to the
routed output; with ``moe_shared_expert_gate`` the output is scaled by ``sigmoid(x @ w_g^T)``,
``w_g`` of shape ``[1, H]`` (Qwen2-MoE style).

The parameter names and shapes are the public state-dict format (docs/architecture.md §6):
``fc1.weight`` ``[2Fs, H]`` for gated activations (the Fs gate rows first, then the Fs up rows)
or ``[Fs, H]``, ``fc2.weight`` ``[H, Fs]`` and, when gated, ``gate.weight`` ``[1, H]``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_moe.layers.activations import activation_fn, is_gated
from lightning_moe.layers.weight_init import write_full

__all__ = ["SharedExpertMLP"]


class SharedExpertMLP(nn.Module):
    """Dense bias-free MLP ``fc2(act(fc1(x)))``, optionally times ``sigmoid(gate(x))``.

    Mirrors Megatron Core's ``SharedExpertMLP`` (``moe_shared_expert_intermediate_size``,
    ``moe_shared_expert_gate``), on one device; tensor parallelism is applied afterwards by
    ``lightning_moe.parallel`` (docs/architecture.md §2).

    Args:
        hidden_size: model width H of input and output.
        ffn_hidden_size: hidden width Fs of the shared expert (all shared experts together, as in
            Megatron where it is ``n_shared * width``).
        activation: name from :data:`lightning_moe.layers.activations.ACTIVATIONS`; a gated one
            (``swiglu``) makes fc1 produce ``2 * Fs`` features laid out ``[gate ; up]``.
        gate: scale the output by a learned per-token sigmoid gate ``sigmoid(x @ gate.weight^T)``.
        activation_params: keyword parameters of the activation (``clamped_swiglu``'s ``alpha`` and
            ``limit``; :data:`lightning_moe.layers.activations.ACTIVATION_PARAMS`).

    Parameters are created with ``nn.Linear``'s default initialisation; the MoE layer calls
    :meth:`reset_parameters` with its own generator for the deterministic scheme of
    docs/architecture.md §8.
    """

    def __init__(
        self, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu", gate: bool = False,
        activation_params: dict[str, float] | None = None,
    ) -> None:
        super().__init__()
        if hidden_size < 1 or ffn_hidden_size < 1:
            raise ValueError(
                f"SharedExpertMLP needs hidden_size >= 1 and ffn_hidden_size >= 1, got "
                f"hidden_size={hidden_size}, ffn_hidden_size={ffn_hidden_size}."
            )
        # Looked up first so an unknown name fails with the activation module's message.
        self.activation_fn = activation_fn(activation, **(activation_params or {}))
        self.activation = activation
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        fc1_width = 2 * ffn_hidden_size if is_gated(activation) else ffn_hidden_size
        self.fc1 = nn.Linear(hidden_size, fc1_width, bias=False)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False)
        # Only registered when enabled so the state dict has no `gate.weight` key otherwise.
        self.gate = nn.Linear(hidden_size, 1, bias=False) if gate else None

    def forward(self, x: Tensor) -> Tensor:
        """Apply the shared expert to ``x`` of shape ``[..., H]``; returns ``[..., H]``."""
        output = self.fc2(self.activation_fn(self.fc1(x)))
        if self.gate is not None:
            output = output * torch.sigmoid(self.gate(x))
        return output

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator, std: float) -> None:
        """Draw every weight from ``Normal(0, std)`` using ``generator`` (Megatron ``init_method_std``).

        The draws happen in a fixed order (fc1, fc2, gate), in fp32 on the generator's device, and
        are copied into the weights, so the same generator state gives the same weights whatever
        the parameters' device and dtype, independent of the global RNG.
        """
        for linear in (self.fc1, self.fc2, self.gate):
            if linear is not None:
                values = torch.empty(linear.weight.shape, dtype=torch.float32, device=generator.device)
                write_full(linear.weight, values.normal_(0.0, std, generator=generator))
                del values  # one drawn tensor alive at a time

    def extra_repr(self) -> str:
        """Show the activation and whether the output gate is on, next to the submodules."""
        return f"activation={self.activation!r}, gate={self.gate is not None}"
