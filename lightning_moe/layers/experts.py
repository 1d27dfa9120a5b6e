"""`GroupedExperts`: the routed experts of one MoE layer, stored as stacked weights.

Weights follow the public state-dict format (DESIGN.md section 2), ``nn.Linear``'s (out, in)
convention with one leading expert dimension:

* ``fc1_weight`` ``[E, 2F, H]`` for gated activations (the F gate rows, then the F up rows) or
  ``[E, F, H]``;
* ``fc2_weight`` ``[E, H, F]``; optional ``fc2_bias`` ``[E, H]`` (scaled by the routing prob).

Expert-tensor parallelism shards fc1 by columns (its gate rows and its up rows separately) and
fc2 by rows, so each rank's block is a slice of these tensors; ``shard_ffn`` records which one.

Two kernels compute the same function (probs multiply the activation output, before fc2):

* ``loop``: :func:`~lightning_moe.layers.expert_kernels.expert_mlp`, one expert at a time with a
  hand-written backward; can fuse the token permutation. Fastest on CPU (see its docstring).
* ``grouped_mm``: ``torch.nn.functional.grouped_mm`` under autograd, one call per GEMM for all
  experts; the choice on CUDA, where it is one kernel launch instead of one per expert.

``kernel="auto"`` picks ``grouped_mm`` on CUDA when the installed torch has it and ``loop``
otherwise (measured in ``benchmarks/moe_layer.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_moe.layers.activations import activation_fn, is_gated
from lightning_moe.layers.expert_kernels import ExpertGradWorkspace, expert_mlp, grouped_activation_fc2

__all__ = ["KERNELS", "GroupedExperts", "expert_generator"]

KERNELS = ("auto", "loop", "grouped_mm")
_HAS_GROUPED_MM = hasattr(F, "grouped_mm")


def expert_generator(layer_seed: int, global_expert: int) -> torch.Generator:
    """The CPU generator that initialises global expert ``global_expert`` of a layer.

    Seeding per (layer seed, global index) makes the weights independent of how experts are
    sharded and of the device the model was built on (DESIGN.md section 3).
    """
    mixed = (layer_seed * 1_000_003 + global_expert * 7_919 + 1) % (2**63 - 1)
    return torch.Generator(device="cpu").manual_seed(mixed)


class GroupedExperts(nn.Module):
    """The routed experts of one MoE layer (or this rank's share of them)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str = "swiglu",
        fc2_bias: bool = False,
        kernel: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"Unknown expert kernel {kernel!r}; choose one of {list(KERNELS)}.")
        self.num_experts = num_experts
        """Experts held here (local experts under expert parallelism)."""
        self.expert_offset = 0
        """Global index of the first expert held here."""
        self.ffn_shard = (0, 1)
        """(rank, size) of this expert-tensor-parallel shard of the F dimension."""
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        self.kernel = kernel
        self.recompute_activation: bool | None = None
        """Recompute the activation output in backward instead of keeping it (Megatron's ``moe_act``
        recompute; saves ``N x F`` elements). None chooses per device: recompute on CPU, where it
        is also faster (measured in ``benchmarks/moe_layer.py``: the activation is redone in cache
        while its gradient reuses the same intermediates), keep it on accelerators. Both kernels
        honour it (``grouped_mm`` then keeps only the fc1 output for the activation and fc2)."""
        self.saved_tensor_tagger: Callable[[str | None, Sequence[Tensor]], None] | None = None
        """Set by ``lightning_moe.memory`` activation offload: called in ``forward`` with the name of
        the boundary the given tensors belong to when saved for backward (``"expert_fc1"``: the
        expert input rows; None: routing metadata such as probs and row indices). Everything else
        the experts save (the fc1 output and activation products) belongs to ``"moe_act"``."""
        self._param_tags: dict[str, dict[str, object]] = {}
        self.grad_workspace: ExpertGradWorkspace | None = ExpertGradWorkspace()
        """Reuse the weight-gradient memory across steps (loop kernel); None allocates fresh each time."""
        fc1_rows = 2 * ffn_hidden_size if is_gated(activation) else ffn_hidden_size
        factory = {"device": device, "dtype": dtype}
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, fc1_rows, hidden_size, **factory))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size, **factory))
        self.fc2_bias = nn.Parameter(torch.empty(num_experts, hidden_size, **factory)) if fc2_bias else None

    def tag_parameter(self, name: str, attribute: str, value: object) -> None:
        """Attach ``attribute`` to parameter ``name`` and keep it attached across conversions.

        ``to_empty`` (meta-device materialisation) and some ``.to()`` calls replace parameter
        objects; the parallel package's shard descriptions must survive that.
        """
        self._param_tags.setdefault(name, {})[attribute] = value
        setattr(getattr(self, name), attribute, value)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name, tags in self._param_tags.items():
            for attribute, value in tags.items():
                setattr(getattr(self, name), attribute, value)
        return self

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_size}, ffn={self.ffn_hidden_size}, "
            f"activation={self.activation}, kernel={self.kernel}"
        )

    @torch.no_grad()
    def reset_parameters(self, layer_seed: int, std: float) -> None:
        """Draw every expert's weights from its own generator (see :func:`expert_generator`).

        The full global expert is drawn and this shard's slice kept, so any expert / tensor
        parallel layout holds the same numbers as one device.
        """
        rank, size = self.ffn_shard
        full_f = self.ffn_hidden_size * size
        gated = is_gated(self.activation)
        for local in range(self.num_experts):
            gen = expert_generator(layer_seed, self.expert_offset + local)
            fc1 = torch.empty(self.fc1_weight.shape[1] * size, self.hidden_size).normal_(0, std, generator=gen)
            fc2 = torch.empty(self.hidden_size, full_f).normal_(0, std, generator=gen)
            block = slice(rank * self.ffn_hidden_size, (rank + 1) * self.ffn_hidden_size)
            if gated:
                gate, up = fc1.chunk(2)
                fc1 = torch.cat([gate[block], up[block]])
            else:
                fc1 = fc1[block]
            self.fc1_weight[local].copy_(fc1)
            self.fc2_weight[local].copy_(fc2[:, block])
        if self.fc2_bias is not None:
            self.fc2_bias.zero_()

    def _recomputes(self, device: torch.device) -> bool:
        if self.recompute_activation is None:
            return device.type == "cpu"
        return self.recompute_activation

    def resolved_kernel(self, device: torch.device, dtype: torch.dtype | None = None) -> str:
        """The kernel ``auto`` stands for on ``device`` for inputs of ``dtype`` (default: the weights').

        CUDA's grouped GEMM takes bf16 (autocast included); everything else runs the loop kernel.
        """
        if self.kernel != "auto":
            return self.kernel
        if device.type != "cuda" or not _HAS_GROUPED_MM:
            return "loop"
        dtype = dtype or self.fc1_weight.dtype
        if torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
        return "grouped_mm" if dtype == torch.bfloat16 else "loop"

    def forward(
        self,
        tokens: Tensor,
        tokens_per_expert: list[int],
        probs: Tensor,
        row_index: Tensor | None = None,
        num_out_rows: int | None = None,
    ) -> Tensor:
        """Apply each expert to its rows.

        Args:
            tokens: ``[N, H]`` rows in expert-major order, or with ``row_index`` the ``[T, H]``
                tokens the rows are gathered from.
            tokens_per_expert: host list of rows per expert (sums to N).
            probs: ``[N]`` routing probability of each row.
            row_index: optional ``[N]`` token index of each row: the rows are gathered from
                ``tokens`` and the outputs summed back per token (a fused permute/unpermute).
            num_out_rows: number of tokens T to sum into (with ``row_index``).

        Returns:
            ``[N, H]`` (or ``[T, H]`` with ``row_index``).
        """
        kernel = self.resolved_kernel(tokens.device, tokens.dtype)
        tag = self.saved_tensor_tagger
        if tag is not None:
            tag("expert_fc1", (tokens,))
            tag(None, (probs,) if row_index is None else (probs, row_index))
        if kernel == "loop":
            return expert_mlp(
                tokens, self.fc1_weight, self.fc2_weight, probs, tokens_per_expert,
                activation=self.activation, fc2_bias=self.fc2_bias, row_index=row_index,
                num_out_rows=num_out_rows, save_activation=not self._recomputes(tokens.device),
                grad_workspace=self.grad_workspace,
            )
        rows = tokens if row_index is None else tokens.index_select(0, row_index)
        if tag is not None:
            tag("expert_fc1", (rows,))
        out = self._grouped_mm(rows, tokens_per_expert, probs)
        if row_index is None:
            return out
        return out.new_zeros(num_out_rows, out.shape[1]).index_add(0, row_index, out)

    def _grouped_mm(self, rows: Tensor, tokens_per_expert: list[int], probs: Tensor) -> Tensor:
        if not _HAS_GROUPED_MM:
            raise RuntimeError(
                "kernel='grouped_mm' needs torch.nn.functional.grouped_mm (torch >= 2.9); "
                "use kernel='loop'."
            )
        offsets = torch.tensor(tokens_per_expert, device=rows.device).cumsum(0).to(torch.int32)
        tag = self.saved_tensor_tagger
        if tag is not None:
            tag(None, (offsets,))
        p = probs.unsqueeze(-1)
        h = F.grouped_mm(rows, self.fc1_weight.transpose(-2, -1), offs=offsets)
        if self._recomputes(rows.device):
            out = grouped_activation_fc2(h, probs, self.fc2_weight, offsets, self.activation)
        else:
            z = (activation_fn(self.activation)(h) * p).to(rows.dtype)
            out = F.grouped_mm(z, self.fc2_weight.transpose(-2, -1), offs=offsets)
        if self.fc2_bias is not None:
            expert_of_row = torch.repeat_interleave(
                torch.arange(self.num_experts, device=rows.device),
                torch.tensor(tokens_per_expert, device=rows.device),
                output_size=rows.shape[0],
            )
            if tag is not None:
                tag(None, (expert_of_row,))
            out = out + (p * self.fc2_bias[expert_of_row]).to(out.dtype)
        return out
