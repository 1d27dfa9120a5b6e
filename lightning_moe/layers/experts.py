"""`GroupedExperts`: the routed experts of one MoE layer, stored as stacked weights.

Weights are stored in ``nn.Linear``'s (out, in) convention with one leading expert dimension:

* ``fc1_weight`` ``[E, 2F, H]`` for gated activations (the F gate rows, then the F up rows, one
  GEMM for both) or ``[E, F, H]``;
* ``fc2_weight`` ``[E, H, F]``; optional ``fc2_bias`` ``[E, H]`` (scaled by the routing prob);
* optional ``fc1_bias``, added to the fc1 output before the activation: ``[E, 2, F]`` for gated
  activations (the gate bias, then the up bias: the checkpoint layout of fc1 itself, so an
  expert-tensor-parallel rank's block is a plain shard of dimension 2) or ``[E, F]``.

The state dict is the public format (docs/architecture.md §6): the same tensors, except that a
gated fc1 is presented as ``[E, 2, F, H]`` (gate, up), a view of the stored one, so that an
expert-tensor-parallel rank's block is a plain shard of it (:mod:`~lightning_moe.layers.expert_state`,
which also loads older ``[E, 2F, H]`` checkpoints).

Expert-tensor parallelism shards fc1 by columns (its gate rows and its up rows separately) and
fc2 by rows, so each rank's block is a slice of these tensors; ``ffn_shard`` records which one.
Each rank's fc2 output is then a partial sum over its F block, summed over the ETP group by the
dispatcher, while ``fc2_bias`` is held whole by every rank: only the rank with ``adds_fc2_bias``
adds it (the others tie it into their graph with a zero gradient), and ``replicated_grad_sum``,
given by the parallel package, sums its gradient over the group where it is used, so every rank
holds the one-device gradient (this module itself never communicates).

Two kernels compute the same function (probs multiply the activation output, before fc2):

* ``loop``: :func:`~lightning_moe.layers.expert_kernels.expert_mlp`, one expert at a time with a
  hand-written backward; can fuse the token permutation. Fastest on CPU (see its docstring).
* ``grouped_mm``: ``torch.nn.functional.grouped_mm`` under autograd, one call per GEMM for all
  experts; the choice on CUDA, where it is one kernel launch instead of one per expert.

``kernel="auto"`` picks ``grouped_mm`` on CUDA where it has a fast path (bf16 compute on sm90 or
newer; elsewhere torch runs it as a per-expert loop that copies the offsets to the host) and
``loop`` otherwise (measured in ``benchmarks/moe_layer.py``).

Both kernels compute in :func:`~lightning_moe.layers.expert_kernels.expert_compute_dtype`: under
``bf16-mixed`` autocast the fp32 weights are cast to bf16 once per optimizer step
(:class:`WeightCastCache`) and the rows once per call, since ``grouped_mm`` is in none of
autocast's cast lists. Outputs keep the input's dtype; per-token sums accumulate in fp32.

``tokens_per_expert`` is a host list or an int64 device tensor (the local dispatcher's dropless
counts): ``grouped_mm`` builds its group offsets on the device, so that path reads nothing from
the device; the loop kernel needs host counts and reads them itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_moe.layers.activations import activation_fn, is_gated
from lightning_moe.layers.expert_kernels import (
    ExpertGradWorkspace,
    accumulation_dtype,
    autocast_disabled,
    expert_compute_dtype,
    expert_mlp,
    grouped_activation_fc2,
)
from lightning_moe.layers.expert_state import accept_checkpoint_layout, present_checkpoint_layout
from lightning_moe.layers.permute import gather_rows, scatter_rows
from lightning_moe.layers.weight_cast_cache import WeightCastCache
from lightning_moe.layers.weight_init import write_full

__all__ = ["KERNELS", "GroupedExperts", "WeightCastCache", "expert_generator", "group_offsets", "host_counts"]

KERNELS = ("auto", "loop", "grouped_mm")
_HAS_GROUPED_MM = hasattr(F, "grouped_mm")
GROUPED_MM_MIN_CAPABILITY = (9, 0)
"""CUDA compute capability from which ``grouped_mm`` has a fast bf16 kernel (sm90, Hopper)."""
_WEIGHTS = ("fc1_weight", "fc2_weight")


def host_counts(tokens_per_expert: Sequence[int] | Tensor) -> list[int]:
    """``tokens_per_expert`` as a host list; a device tensor is read (one device-to-host copy)."""
    if isinstance(tokens_per_expert, Tensor):
        return tokens_per_expert.tolist()
    return [int(c) for c in tokens_per_expert]


def group_offsets(tokens_per_expert: Sequence[int] | Tensor, device: torch.device) -> Tensor:
    """int32 end offsets of the expert segments (``grouped_mm``'s ``offs``), on ``device``.

    Built on the device without any host copy from a device tensor, or from a host list whose
    counts are all equal (drop-and-pad); other host lists are copied to the device once.
    """
    if isinstance(tokens_per_expert, Tensor):
        return tokens_per_expert.to(device).cumsum(0, dtype=torch.int32)
    counts = [int(c) for c in tokens_per_expert]
    if counts and all(c == counts[0] for c in counts):
        return torch.arange(1, len(counts) + 1, device=device, dtype=torch.int32) * counts[0]
    return torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=device)


class _ZeroGradUse(torch.autograd.Function):
    """``out`` unchanged, with ``unused`` in its graph receiving a zero gradient.

    A rank that holds a tensor but does not use it still has to reach the backward of whatever
    ``unused`` went through (a gradient sum over the ranks that all of them must join).
    """

    @staticmethod
    def forward(ctx, out, unused):
        ctx.unused = (unused.shape, unused.dtype, unused.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.unused
        unused_grad = torch.zeros(shape, dtype=dtype, device=device) if ctx.needs_input_grad[1] else None
        return grad, unused_grad


def expert_generator(layer_seed: int, global_expert: int) -> torch.Generator:
    """The CPU generator that initialises global expert ``global_expert`` of a layer.

    Seeding per (layer seed, global index) makes the weights independent of how experts are
    sharded and of the device the model was built on (docs/architecture.md §8).
    """
    mixed = (layer_seed * 1_000_003 + global_expert * 7_919 + 1) % (2**63 - 1)
    return torch.Generator(device="cpu").manual_seed(mixed)


class GroupedExperts(nn.Module):
    """The routed experts of one MoE layer (or this rank's share of them)."""

    accepts_device_counts: bool = True
    """``forward`` takes ``tokens_per_expert`` as a device tensor; otherwise the MoE layer reads it."""
    accepts_permutation_flag: bool = True
    """``forward`` takes ``row_index_is_permutation``; otherwise the MoE layer does not pass it."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # A subclass with its own forward keeps the older protocol unless it declares otherwise.
        if "forward" in cls.__dict__:
            for name in ("accepts_device_counts", "accepts_permutation_flag"):
                if name not in cls.__dict__:
                    setattr(cls, name, False)

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
        fc1_bias: bool = False,
        activation_params: dict[str, float] | None = None,
    ) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"Unknown expert kernel {kernel!r}; choose one of {list(KERNELS)}.")
        activation_params = dict(activation_params or {})
        activation_fn(activation, **activation_params)  # unknown names or parameters raise here
        self.num_experts = num_experts
        """Experts held here (local experts under expert parallelism)."""
        self.expert_offset = 0
        """Global index of the first expert held here."""
        self.ffn_shard = (0, 1)
        """(rank, size) of this expert-tensor-parallel shard of the F dimension."""
        self.sharded_state_dict = False
        """Set by ``lightning_moe.parallel`` when its own hooks present this module's state dict
        (global DTensors, either fc1 layout accepted): the one-device layout hooks then stand aside."""
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        self.activation_params = activation_params
        """Keyword parameters of the activation (``alpha`` and ``limit`` of ``clamped_swiglu``)."""
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
        self.adds_fc2_bias = True
        """This rank adds ``fc2_bias`` to its output. Under expert-tensor parallelism every rank's
        output is a partial sum over its F block, summed over the ETP group afterwards, so
        ``lightning_moe.parallel`` leaves this True on ETP rank 0 only (the bias is added once)."""
        self.replicated_grad_sum: Callable[[Tensor], Tensor] | None = None
        """Applied to ``fc2_bias`` where it is used: the identity, whose backward sums the gradient
        over the ranks holding the same whole tensor (set by ``lightning_moe.parallel`` under
        expert-tensor parallelism; None: the gradient is whole already)."""
        self._param_tags: dict[str, dict[str, object]] = {}
        self.grad_workspace: ExpertGradWorkspace | None = ExpertGradWorkspace()
        """Reuse the weight-gradient memory across steps (loop kernel); None allocates fresh each time."""
        self.weight_casts: WeightCastCache | None = WeightCastCache()
        """Narrower-dtype copies of the weights for autocast, once per step; None casts on every call."""
        fc1_rows = 2 * ffn_hidden_size if is_gated(activation) else ffn_hidden_size
        factory = {"device": device, "dtype": dtype}
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, fc1_rows, hidden_size, **factory))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size, **factory))
        self.fc2_bias = nn.Parameter(torch.empty(num_experts, hidden_size, **factory)) if fc2_bias else None
        fc1_bias_shape = (num_experts, 2, ffn_hidden_size) if is_gated(activation) else (num_experts, ffn_hidden_size)
        self.fc1_bias = nn.Parameter(torch.empty(fc1_bias_shape, **factory)) if fc1_bias else None
        self.register_state_dict_post_hook(present_checkpoint_layout)
        self.register_load_state_dict_pre_hook(accept_checkpoint_layout)

    def expert_tensors(self) -> dict[str, tuple[int | None, bool, int]]:
        """Every stacked per-expert parameter, by name: ``(F dimension, gated, H-like dimension)``.

        The F dimension is the one expert-tensor parallelism cuts (None: every ETP rank holds the
        whole tensor), ``gated``: that axis is ``[gate ; up]`` with each half cut separately, and
        the last entry the dimension sharded data parallelism splits over EDP. Expert parallelism
        cuts dimension 0 of all of them. Subclasses with more stacked parameters (adapters) add theirs.
        """
        tensors: dict[str, tuple[int | None, bool, int]] = {
            "fc1_weight": (1, is_gated(self.activation), 2), "fc2_weight": (2, False, 1),
        }
        if self.fc2_bias is not None:
            tensors["fc2_bias"] = (None, False, 1)
        if self.fc1_bias is not None:
            # [E, 2, F] (gated) or [E, F]: ETP cuts F, a plain shard; it has no H, so sharded data
            # parallelism splits F too.
            f_dim = self.fc1_bias.dim() - 1
            tensors["fc1_bias"] = (f_dim, False, f_dim)
        return tensors

    def place_weight_grad(self, param: Tensor, memory: Tensor | None) -> bool:
        """Have the expert kernel write ``param``'s gradient into ``memory`` from the next backward on
        (None: into memory of its own again, letting go of the placed one).

        ``param`` is ``fc1_weight`` or ``fc2_weight`` and ``memory`` a tensor of its local shape,
        dtype and device (a gradient bucket's slot: :class:`~lightning_moe.layers.expert_kernels.ExpertGradWorkspace`
        explains when it is used). Returns False, changing nothing, for any other tensor or without
        a ``grad_workspace``.
        """
        if self.grad_workspace is None:
            return False
        for name in ("fc1", "fc2"):
            weight = getattr(self, f"{name}_weight")
            fits = memory is None or (memory.shape == weight.shape and memory.dtype == weight.dtype)
            if weight is param and fits:
                self.grad_workspace.place(name, memory)
                return True
        return False

    def tag_parameter(self, name: str, attribute: str, value: object) -> None:
        """Attach ``attribute`` to parameter ``name`` and keep it attached across conversions.

        ``to_empty`` (meta-device materialisation) and some ``.to()`` calls replace parameter
        objects; the parallel package's shard descriptions must survive that.
        """
        self._param_tags.setdefault(name, {})[attribute] = value
        setattr(getattr(self, name), attribute, value)

    def _apply(self, fn, recurse=True):
        # Conversions may swap parameter data without bumping its version: the copies are stale.
        if getattr(self, "weight_casts", None) is not None:
            self.weight_casts.clear()
        super()._apply(fn, recurse)
        for name, tags in self._param_tags.items():
            for attribute, value in tags.items():
                setattr(getattr(self, name), attribute, value)
        return self

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_size}, ffn={self.ffn_hidden_size}, "
            f"activation={self.activation}, kernel={self.kernel}, fc1_bias={self.fc1_bias is not None}, "
            f"fc2_bias={self.fc2_bias is not None}"
        )

    @torch.no_grad()
    def reset_parameters(self, layer_seed: int, std: float) -> None:
        """Draw every expert's weights from its own generator (see :func:`expert_generator`).

        Each global expert's fc1 and then its fc2 are drawn in full and this shard's slice kept, so
        any expert / tensor parallel layout holds the same numbers as one device. One drawn tensor
        is alive at a time (one expert's fc1 at most): never a layer's experts.
        """
        rank, size = self.ffn_shard
        local_f = self.ffn_hidden_size
        block = slice(rank * local_f, (rank + 1) * local_f)
        for local in range(self.num_experts):
            gen = expert_generator(layer_seed, self.expert_offset + local)
            # On the CPU, like the generator, whatever default device is active (Lightning builds
            # models under the accelerator's device context).
            fc1 = torch.empty(self.fc1_weight.shape[1] * size, self.hidden_size, device="cpu")
            fc1.normal_(0, std, generator=gen)
            if is_gated(self.activation):
                if size > 1:
                    # This shard's gate rows then its up rows, moved to the top of the drawn tensor
                    # (no second copy). Sources and targets never overlap: the up rows start at
                    # full F >= 2 * local F, and the gate block moves only when it is not the first.
                    full_f = local_f * size
                    if rank:
                        fc1[:local_f] = fc1[block]
                    fc1[local_f : 2 * local_f] = fc1[full_f + block.start : full_f + block.stop]
                write_full(self.fc1_weight, fc1[: 2 * local_f], index=local)
            else:
                write_full(self.fc1_weight, fc1[block], index=local)
            del fc1  # before fc2 is drawn
            fc2 = torch.empty(self.hidden_size, local_f * size, device="cpu").normal_(0, std, generator=gen)
            write_full(self.fc2_weight, fc2[:, block], index=local)
            del fc2
        if self.fc2_bias is not None:
            self.fc2_bias.zero_()
        if self.fc1_bias is not None:
            self.fc1_bias.zero_()

    def _recomputes(self, device: torch.device) -> bool:
        if self.recompute_activation is None:
            return device.type == "cpu"
        return self.recompute_activation

    def resolved_kernel(self, device: torch.device, dtype: torch.dtype | None = None) -> str:
        """The kernel ``auto`` stands for on ``device`` for inputs of ``dtype`` (default: the weights').

        ``grouped_mm`` where it has a fast kernel: CUDA, bf16 compute (autocast included) and
        compute capability :data:`GROUPED_MM_MIN_CAPABILITY` or newer. Elsewhere torch runs it
        as a per-expert loop that copies the offsets to the host; the loop kernel is used instead.
        """
        if self.kernel != "auto":
            return self.kernel
        if device.type != "cuda" or not _HAS_GROUPED_MM:
            return "loop"
        if expert_compute_dtype(dtype or self.fc1_weight.dtype, device) != torch.bfloat16:
            return "loop"
        fast = tuple(torch.cuda.get_device_capability(device)) >= GROUPED_MM_MIN_CAPABILITY
        return "grouped_mm" if fast else "loop"

    def _compute_weights(self, dtype: torch.dtype, whole: bool) -> tuple[Tensor, Tensor]:
        """fc1 and fc2 for GEMMs in ``dtype``: the parameters, or (narrower dtype) their cached copies.

        ``whole``: the kernel needs whole tensors of ``dtype`` (``grouped_mm``); the loop kernel
        casts a wider dtype expert by expert itself, which keeps no full-size copy.
        """
        cache, weights, cached = self.weight_casts, [], False
        for name in _WEIGHTS:
            param = getattr(self, name)
            if param.dtype == dtype:
                weights.append(param)
            elif cache is not None and torch.finfo(dtype).bits < torch.finfo(param.dtype).bits:
                weights.append(cache.get(name, param, dtype))
                cached = True
            else:
                weights.append(param.to(dtype) if whole else param)
        if cache is not None and not cached:
            cache.clear()  # nothing needs the copies now: do not hold their memory
        return weights[0], weights[1]

    def forward(
        self,
        tokens: Tensor,
        tokens_per_expert: Sequence[int] | Tensor,
        probs: Tensor,
        row_index: Tensor | None = None,
        num_out_rows: int | None = None,
        row_index_is_permutation: bool = False,
    ) -> Tensor:
        """Apply each expert to its rows.

        Args:
            tokens: ``[N, H]`` rows in expert-major order, or with ``row_index`` the ``[T, H]``
                tokens the rows are gathered from.
            tokens_per_expert: rows per expert (sums to N): a host list, or an int64 ``[E]`` device
                tensor (read to the host only by the loop kernel).
            probs: ``[N]`` routing probability of each row.
            row_index: optional ``[N]`` token index of each row: the rows are gathered from
                ``tokens`` and the outputs summed back per token (a fused permute/unpermute).
            num_out_rows: number of tokens T to sum into (with ``row_index``).
            row_index_is_permutation: ``row_index`` holds each of the ``T = N`` rows exactly once
                (the all-to-all dispatcher's received rows): scattered with ``index_copy``
                (deterministic) instead of ``index_add``.

        Returns:
            ``[N, H]`` (or ``[T, H]`` with ``row_index``), in ``tokens``' dtype.
        """
        device = tokens.device
        cdt = expert_compute_dtype(tokens.dtype, device)
        kernel = self.resolved_kernel(device, tokens.dtype)
        # Sizes of a declared permutation are checked by expert_mlp, or by gather_rows/scatter_rows.
        permutation = bool(row_index_is_permutation) and row_index is not None
        fc1, fc2 = self._compute_weights(cdt, whole=kernel != "loop")
        fc2_bias = self.fc2_bias_in_use()
        tag = self.saved_tensor_tagger
        if tag is not None:
            tag("expert_fc1", (tokens,))
            tag(None, (probs,) if row_index is None else (probs, row_index))
            # Cast copies of the weights are parameters in all but name: never offloaded.
            tag(None, tuple(w for w, name in zip((fc1, fc2), _WEIGHTS) if w is not getattr(self, name)))
            if fc2_bias is not self.fc2_bias:
                tag(None, (fc2_bias,))  # the bias through its gradient sum: a parameter too
        if kernel == "loop":
            out = expert_mlp(
                tokens, fc1, fc2, probs, host_counts(tokens_per_expert),
                activation=self.activation, fc2_bias=fc2_bias if self.adds_fc2_bias else None, row_index=row_index,
                fc1_bias=self.flat_fc1_bias(), activation_params=self.activation_params,
                num_out_rows=num_out_rows, save_activation=not self._recomputes(device),
                grad_workspace=self.grad_workspace, compute_dtype=cdt, row_index_is_permutation=permutation,
            )
            return out if fc2_bias is None or self.adds_fc2_bias else _ZeroGradUse.apply(out, fc2_bias)
        # Explicit dtypes throughout: autocast would recast some of the ops below, not grouped_mm.
        with autocast_disabled(device):
            # Gathered in the input's dtype, so the input gradient is summed per token in it.
            rows = tokens if row_index is None else gather_rows(tokens, row_index, permutation)
            rows = rows.to(cdt)
            if tag is not None:
                tag("expert_fc1", (rows,))
            out = self._grouped_mm(rows, tokens_per_expert, probs, fc1, fc2, fc2_bias)
            if row_index is None:
                return out.to(tokens.dtype)
            out = scatter_rows(out, row_index, num_out_rows, permutation, dtype=accumulation_dtype(cdt))
            return out.to(tokens.dtype)

    def fc2_bias_in_use(self) -> Tensor | None:
        """``fc2_bias`` as the kernels use it: through ``replicated_grad_sum`` when set (None without a bias).

        Called once per forward on every rank, ``adds_fc2_bias`` or not, and before the expert
        GEMMs: the gradient sums then run at the same point of every rank's backward.
        """
        if self.fc2_bias is None or self.replicated_grad_sum is None:
            return self.fc2_bias
        return self.replicated_grad_sum(self.fc2_bias)

    def add_fc2_bias(self, out: Tensor, probs: Tensor, expert_of_row: Tensor | None, fc2_bias: Tensor | None) -> Tensor:
        """``out`` ``[N, H]`` plus ``probs * fc2_bias[expert]`` of each row on the rank that adds the bias.

        ``probs`` is ``[N, 1]``, ``expert_of_row`` the local expert of every row and ``fc2_bias``
        :meth:`fc2_bias_in_use`'s tensor (None: ``out`` unchanged). Without ``adds_fc2_bias`` the
        bias is only kept in the graph, with a zero gradient.
        """
        if fc2_bias is None:
            return out
        if not self.adds_fc2_bias:
            return _ZeroGradUse.apply(out, fc2_bias)
        return out + (probs * fc2_bias[expert_of_row]).to(out.dtype)

    def flat_fc1_bias(self) -> Tensor | None:
        """``fc1_bias`` as ``[E, F1]`` rows matching fc1's stored rows (``[gate ; up]``): a view."""
        return None if self.fc1_bias is None else self.fc1_bias.flatten(1)

    def row_experts(self, offsets: Tensor, num_rows: int) -> Tensor:
        """The local expert of every expert-major row, from the device offsets (no host counts)."""
        positions = torch.arange(num_rows, device=offsets.device, dtype=offsets.dtype)
        return torch.searchsorted(offsets, positions, right=True)

    def _grouped_mm(
        self, rows: Tensor, tokens_per_expert: Sequence[int] | Tensor, probs: Tensor, fc1: Tensor, fc2: Tensor,
        fc2_bias: Tensor | None,
    ) -> Tensor:
        if not _HAS_GROUPED_MM:
            raise RuntimeError(
                "kernel='grouped_mm' needs torch.nn.functional.grouped_mm (torch >= 2.9); "
                "use kernel='loop'."
            )
        offsets = group_offsets(tokens_per_expert, rows.device)
        tag = self.saved_tensor_tagger
        if tag is not None:
            tag(None, (offsets,))
        p = probs.unsqueeze(-1)
        expert_of_row = None
        if self.fc1_bias is not None or (self.fc2_bias is not None and self.adds_fc2_bias):
            expert_of_row = self.row_experts(offsets, rows.shape[0])
            if tag is not None:
                tag(None, (expert_of_row,))
        h = F.grouped_mm(rows, fc1.transpose(-2, -1), offs=offsets)
        if self.fc1_bias is not None:
            h = h + self.flat_fc1_bias()[expert_of_row].to(h.dtype)
        if self._recomputes(rows.device):
            out = grouped_activation_fc2(h, probs, fc2, offsets, self.activation, self.activation_params)
        else:
            z = (activation_fn(self.activation, **self.activation_params)(h) * p).to(rows.dtype)
            out = F.grouped_mm(z, fc2.transpose(-2, -1), offs=offsets)
        return self.add_fc2_bias(out, p, expert_of_row, fc2_bias)
