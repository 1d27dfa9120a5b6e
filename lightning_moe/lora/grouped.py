"""Per-expert LoRA adapters on the routed experts, computed as grouped GEMMs over the permuted rows.

:class:`LoRAGroupedExperts` is a :class:`~lightning_moe.layers.experts.GroupedExperts` (same base
parameters, state-dict keys, kernels' row order and dispatcher protocol) with four more stacked
parameters, one adapter per expert:

* ``fc1_lora_A`` ``[E, r, H]`` and ``fc1_lora_B`` ``[E, F1, r]``: the update of fc1 ``[E, F1, H]``;
* ``fc2_lora_A`` ``[E, r, F]`` and ``fc2_lora_B`` ``[E, H, r]``: the update of fc2 ``[E, H, F]``.

Expert ``e`` computes with ``W_e + alpha/r * B_e @ A_e``. A gated fc1 is one matrix ``[gate ; up]``
(``F1 = 2F``, stored as the base weight is: the F gate rows, then the F up rows), so its adapter
is one rank-r adapter of that matrix: ``A`` is shared by the gate and the up projection and
``B``'s first F rows update the gate, the last F the up projection. It is exactly two adapters
``(A, B[:F])`` and ``(A, B[F:])`` of separate gate and up projections (the form of per-projection
adapter formats such as PEFT's). In the state dict ``fc1_lora_B`` of a gated fc1 is
presented like ``fc1_weight``, as ``[E, 2, F, r]`` (gate, up), so that an expert-tensor-parallel
rank's block is a plain shard of it.

The forward pass runs on the rows in the experts' expert-major order with
``torch.nn.functional.grouped_mm`` over the same group offsets: the frozen base GEMM, then
``x A_e^T`` (``[N, r]``) and ``(x A_e^T) B_e^T`` for the adapter, added before the activation (fc1)
and to the output (fc2). No Python loop over experts; the base weights get no gradient. Ranks
that are not a multiple of 8 are padded with zero rows of ``A`` / columns of ``B`` inside the
computation (``grouped_mm`` needs 16-byte aligned strides); H and the local F must be multiples
of 8.

Under expert-tensor parallelism (each rank holds an F block) ``fc1_lora_B`` and ``fc2_lora_A``
are cut along F like the base weights, ``fc1_lora_A`` and ``fc2_lora_B`` are held whole by every
ETP rank; each rank computes the part of their gradient that its F block gives, and the forward
pass sums those parts over ETP where it uses them (``partial_grad_group``, set by
:mod:`lightning_moe.parallel.expert_parallel`; :func:`~lightning_moe.parallel.collectives.sum_grad`):
the same numbers as one device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_moe.layers.activations import activation_fn, is_gated
from lightning_moe.layers.expert_kernels import accumulation_dtype, autocast_disabled, expert_compute_dtype
from lightning_moe.layers.expert_state import fc1_checkpoint_view, fc1_from_checkpoint
from lightning_moe.layers.experts import GroupedExperts, expert_generator, group_offsets
from lightning_moe.layers.permute import gather_rows, scatter_rows
from lightning_moe.layers.weight_init import write_full
from lightning_moe.parallel.collectives import sum_grad

__all__ = ["ADAPTER_NAMES", "ALIGN", "LoRAGroupedExperts", "grouped_lora"]

ADAPTER_NAMES = ("fc1_lora_A", "fc1_lora_B", "fc2_lora_A", "fc2_lora_B")
"""The adapters' parameter names on the experts module."""
ALIGN = 8
"""Sizes (H, local F, padded rank) are multiples of this: ``grouped_mm`` needs 16-byte aligned strides."""
_GATED_B = "fc1_lora_B"


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: ``grouped_mm``'s backward refuses
    expanded gradients (e.g. of a ``sum``)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """``x_e @ weight_e^T`` for every expert's rows of ``x`` (``weight`` ``[E, out, in]``)."""
    return _ContiguousGrad.apply(F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets))


def grouped_lora(x: Tensor, a: Tensor, b: Tensor, offsets: Tensor, scale: float) -> Tensor:
    """``scale * x_e A_e^T B_e^T`` for every expert's rows: two grouped GEMMs.

    Args:
        x: ``[N, in]`` rows in expert-major order.
        a: ``[E, r, in]``; b: ``[E, out, r]`` (cast to ``x``'s dtype).
        offsets: int32 ``[E]`` end offsets of the experts' rows (``grouped_mm``'s ``offs``).
        scale: ``alpha / r``.

    Returns:
        ``[N, out]`` in ``x``'s dtype.
    """
    pad = -a.shape[1] % ALIGN
    a, b = a.to(x.dtype), b.to(x.dtype)
    if pad:
        # Zero rows of A and zero columns of B change nothing but the strides.
        a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
    return _grouped(_grouped(x, a, offsets), b, offsets) * scale


def _one_device_gated_b(module: nn.Module, value: object) -> bool:
    return (
        isinstance(value, Tensor) and is_gated(module.activation)
        and not getattr(module, "sharded_state_dict", False) and not hasattr(value, "placements")
    )


def present_adapter_layout(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook: a gated fc1's ``fc1_lora_B`` ``[E, 2F, r]`` as ``[E, 2, F, r]`` (a view)."""
    key = prefix + _GATED_B
    value = state_dict.get(key)
    if _one_device_gated_b(module, value) and value.dim() == 3:
        state_dict[key] = fc1_checkpoint_view(value)


def accept_adapter_layout(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook: ``fc1_lora_B`` ``[E, 2, F, r]`` back to the stored ``[E, 2F, r]``."""
    key = prefix + _GATED_B
    value = state_dict.get(key)
    if _one_device_gated_b(module, value) and value.dim() == 4:
        state_dict[key] = fc1_from_checkpoint(value)


class LoRAGroupedExperts(GroupedExperts):
    """Routed experts with one LoRA adapter per expert on fc1 and fc2 (module docstring).

    Made from a ``GroupedExperts`` by :meth:`convert` (:func:`lightning_moe.lora.apply_lora` does it).
    """

    accepts_device_counts = True
    accepts_permutation_flag = True

    lora_scale: float
    lora_dropout: float
    lora_seed: int
    partial_grad_group: object = None
    """Process group over which ``fc1_lora_A`` and ``fc2_lora_B`` have partial gradients (ETP; None: whole)."""

    @classmethod
    def convert(cls, experts: GroupedExperts, rank: int, scale: float, dropout: float, seed: int) -> LoRAGroupedExperts:
        """Turn ``experts`` (one device, not parallelised yet) into adapted experts, in place.

        The adapters are created on the base weights' device (meta stays meta, to be drawn by
        ``reset_parameters`` after materialisation), ``A`` drawn from ``seed`` per global expert and
        ``B`` zero. Returns ``experts``.
        """
        if type(experts) is not GroupedExperts:
            raise TypeError(
                f"LoRA adapts lightning_moe GroupedExperts; got {type(experts).__name__}, a subclass with its own "
                "kernel (FP8, or already adapted). Apply LoRA before converting the experts."
            )
        if experts.expert_offset != 0:
            raise RuntimeError("apply LoRA before expert parallelism (the adapters are sharded with the experts).")
        for name, size in (("hidden_size", experts.hidden_size), ("ffn_hidden_size", experts.ffn_hidden_size)):
            if size % ALIGN:
                raise ValueError(
                    f"LoRA on routed experts needs the experts' {name} to be a multiple of {ALIGN} (grouped GEMMs "
                    f"need aligned rows), got {size}; leave 'experts' out of LoRAConfig.targets for this model."
                )
        experts.__class__ = cls
        experts.lora_scale, experts.lora_dropout, experts.lora_seed = float(scale), float(dropout), int(seed)
        e, h, f1, f = experts.num_experts, experts.hidden_size, experts.fc1_weight.shape[1], experts.ffn_hidden_size
        factory = {"device": experts.fc1_weight.device, "dtype": torch.float32}
        shapes = {"fc1_lora_A": (e, rank, h), "fc1_lora_B": (e, f1, rank), "fc2_lora_A": (e, rank, f),
                  "fc2_lora_B": (e, h, rank)}
        for name, shape in shapes.items():
            setattr(experts, name, nn.Parameter(torch.empty(shape, **factory)))
        experts.register_state_dict_post_hook(present_adapter_layout)
        experts.register_load_state_dict_pre_hook(accept_adapter_layout)
        if not experts.fc1_weight.is_meta:
            experts.reset_adapter_parameters()
        return experts

    @property
    def lora_rank(self) -> int:
        """The adapters' rank r."""
        return self.fc1_lora_A.shape[1]

    def expert_tensors(self) -> dict[str, tuple[int | None, bool, int]]:
        """The base tensors and the adapters: ``fc1_lora_B`` is cut along F like fc1 (gated: per half),
        ``fc2_lora_A`` along F like fc2; ``fc1_lora_A`` and ``fc2_lora_B`` are not cut over ETP.
        Sharded data parallelism splits H where a factor has it, else the rank dimension."""
        tensors = super().expert_tensors()
        tensors.update({
            "fc1_lora_A": (None, False, 2), "fc1_lora_B": (1, is_gated(self.activation), 2),
            "fc2_lora_A": (2, False, 1), "fc2_lora_B": (None, False, 1),
        })
        return tensors

    @torch.no_grad()
    def reset_parameters(self, layer_seed: int, std: float) -> None:
        """The base experts' weights (see ``GroupedExperts``), then the adapters'."""
        super().reset_parameters(layer_seed, std)
        self.reset_adapter_parameters()

    @torch.no_grad()
    def reset_adapter_parameters(self) -> None:
        """``A`` of every global expert drawn in full from (``lora_seed``, expert index) and this
        shard's block kept, so every layout holds the one-device numbers; ``B`` zero."""
        rank, size = self.ffn_shard
        local_f, hidden = self.ffn_hidden_size, self.hidden_size
        full_f = local_f * size
        for local in range(self.num_experts):
            gen = expert_generator(self.lora_seed, self.expert_offset + local)
            bound = 1.0 / math.sqrt(hidden)
            a1 = torch.empty(self.lora_rank, hidden, device="cpu").uniform_(-bound, bound, generator=gen)
            write_full(self.fc1_lora_A, a1, index=local)
            bound = 1.0 / math.sqrt(full_f)
            a2 = torch.empty(self.lora_rank, full_f, device="cpu").uniform_(-bound, bound, generator=gen)
            write_full(self.fc2_lora_A, a2[:, rank * local_f:(rank + 1) * local_f], index=local)
        self.fc1_lora_B.zero_()
        self.fc2_lora_B.zero_()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.lora_rank}, lora_scale={self.lora_scale}"

    def _adapter_input(self, x: Tensor) -> Tensor:
        if self.lora_dropout and self.training:
            return F.dropout(x, self.lora_dropout, training=True)
        return x

    def forward(
        self,
        tokens: Tensor,
        tokens_per_expert: Sequence[int] | Tensor,
        probs: Tensor,
        row_index: Tensor | None = None,
        num_out_rows: int | None = None,
        row_index_is_permutation: bool = False,
    ) -> Tensor:
        """As ``GroupedExperts.forward``, every expert computing with its adapted weights.

        Runs the grouped GEMMs on every device (torch's ``grouped_mm``; on CPU and older GPUs torch
        loops over the experts inside it).
        """
        device = tokens.device
        cdt = expert_compute_dtype(tokens.dtype, device)
        permutation = bool(row_index_is_permutation) and row_index is not None
        fc1, fc2 = self._compute_weights(cdt, whole=True)
        tag = self.saved_tensor_tagger
        if tag is not None:
            tag(None, (probs,) if row_index is None else (probs, row_index))
            tag(None, tuple(w for w, name in zip((fc1, fc2), ("fc1_weight", "fc2_weight")) if w is not getattr(self, name)))
        with autocast_disabled(device):
            rows = tokens if row_index is None else gather_rows(tokens, row_index, permutation)
            rows = rows.to(cdt)
            if tag is not None:
                tag("expert_fc1", (rows,))
            offsets = group_offsets(tokens_per_expert, device)
            if tag is not None:
                tag(None, (offsets,))
            s, group = self.lora_scale, self.partial_grad_group
            fc2_bias = self.fc2_bias_in_use()
            expert_of_row = None
            if self.fc1_bias is not None or self.fc2_bias is not None:
                expert_of_row = self.row_experts(offsets, rows.shape[0])
            h = _grouped(rows, fc1, offsets)
            h = h + grouped_lora(self._adapter_input(rows), sum_grad(self.fc1_lora_A, group), self.fc1_lora_B, offsets, s)
            if self.fc1_bias is not None:
                h = h + self.flat_fc1_bias()[expert_of_row].to(h.dtype)
            p = probs.unsqueeze(-1)
            z = (activation_fn(self.activation, **self.activation_params)(h) * p).to(cdt)
            out = _grouped(z, fc2, offsets)
            out = out + grouped_lora(self._adapter_input(z), self.fc2_lora_A, sum_grad(self.fc2_lora_B, group), offsets, s)
            out = self.add_fc2_bias(out, p, expert_of_row, fc2_bias)
            if row_index is None:
                return out.to(tokens.dtype)
            out = scatter_rows(out, row_index, num_out_rows, permutation, dtype=accumulation_dtype(cdt))
            return out.to(tokens.dtype)

    @torch.no_grad()
    def merged_weights(self) -> tuple[Tensor, Tensor]:
        """``(fc1, fc2)`` with the adapters folded in, in the base weights' dtype (local shards)."""
        s = self.lora_scale
        fc1 = self.fc1_weight.float() + s * torch.bmm(self.fc1_lora_B.float(), self.fc1_lora_A.float())
        fc2 = self.fc2_weight.float() + s * torch.bmm(self.fc2_lora_B.float(), self.fc2_lora_A.float())
        return fc1.to(self.fc1_weight.dtype), fc2.to(self.fc2_weight.dtype)
