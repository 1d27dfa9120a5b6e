"""`VocabParallelEmbedding`: a token embedding sharded over the vocabulary, forward and backward.

Megatron Core's ``VocabParallelEmbedding``: each tensor-parallel rank holds the rows
``[start, start + V / TP)`` of the ``[V, H]`` weight and looks up only the ids in that range; the
others are mapped to a valid local row and their output rows set to zero, so the partial outputs
sum over TP to the lookup of every id (exactly: each sum has one non-zero term). The sum is an
all-reduce, or under sequence parallelism a reduce-scatter over the sequence (the output layout
the style is given, as torch's ``RowwiseParallel`` produces it).

Why not torch's ``RowwiseParallel`` on ``nn.Embedding``: DTensor has no vocabulary-parallel rule
for the embedding's backward, so it runs ``embedding_dense_backward`` replicated, a ``[V, H]``
gradient of the whole vocabulary on every rank (1.16 GiB in fp32 for Qwen3-30B-A3B), and then
keeps this rank's rows of it. Here the lookup runs on the local rows as a plain tensor, so the
backward computes the ``[V / TP, H]`` gradient of those rows only.

The weight stays a DTensor ``Shard(0)`` of global shape ``[V, H]`` (state dicts, checkpoints,
FSDP2 over it and the gradient synchroniser see what ``RowwiseParallel`` gave them); its
gradient arrives with the same layout. Ids outside ``[0, V)``, negative ones included, give zero
rows on every rank (as ``RowwiseParallel`` and Megatron do): the Lightning module refuses such
batches before they reach the model (``check_token_ids``).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_moe.compat import compute_local_shape_and_global_offset

__all__ = ["VocabParallelEmbedding", "VocabParallelEmbeddingModule"]


class VocabParallelEmbedding(ParallelStyle):
    """Shard an ``nn.Embedding`` over the vocabulary on a one-dimensional TP mesh (Megatron's layout).

    Args:
        output_layout: the output's layout over TP: ``Shard(1)`` (the default; sequence
            parallelism: a reduce-scatter over the sequence of ``[B, S, H]``) or ``Replicate()``
            (an all-reduce).
        use_local_output: return this rank's local tensor instead of the DTensor.

    The module's input is the token ids, the same on every rank of the TP group (a plain tensor,
    or a DTensor that is gathered first). ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` are
    refused: each needs the whole vocabulary or the whole batch's counts on one rank.
    """

    def __init__(self, *, output_layout: Placement | None = None, use_local_output: bool = False) -> None:
        super().__init__()
        output_layout = Shard(1) if output_layout is None else output_layout
        if not isinstance(output_layout, (Shard, Replicate)):
            raise ValueError(
                f"VocabParallelEmbedding's output_layout must be Shard(dim) or Replicate(), got {output_layout}."
            )
        self.output_layout = output_layout
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) is not nn.Embedding:
            raise TypeError(
                f"VocabParallelEmbedding shards a torch.nn.Embedding, got {type(module).__name__}; give the "
                "model a plain nn.Embedding or shard this module with torch's RowwiseParallel."
            )
        if device_mesh.ndim != 1:
            raise ValueError(
                f"VocabParallelEmbedding needs a one-dimensional tensor-parallel mesh, got {device_mesh.ndim} "
                f"dimensions {device_mesh.mesh_dim_names}; pass the mesh's 'tp' dimension."
            )
        unsupported = {
            "max_norm": module.max_norm,
            "scale_grad_by_freq": module.scale_grad_by_freq,
            "sparse": module.sparse,
        }
        unsupported = {name: value for name, value in unsupported.items() if value not in (None, False)}
        if unsupported:
            raise ValueError(
                f"VocabParallelEmbedding cannot shard an nn.Embedding with {unsupported}: each needs the whole "
                "vocabulary or the whole batch on one rank; use the defaults (max_norm=None, "
                "scale_grad_by_freq=False, sparse=False) or tensor parallel size 1."
            )
        weight = module.weight
        module.register_parameter(
            "weight",
            nn.Parameter(
                distribute_tensor(weight, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                requires_grad=weight.requires_grad,
            ),
        )
        (rows, _), (start, _) = compute_local_shape_and_global_offset(
            module.weight.shape, device_mesh, [Shard(0)]
        )
        module.__class__ = VocabParallelEmbeddingModule
        module.tp_mesh = device_mesh
        module.vocab_start, module.vocab_end = start, start + rows
        module.output_layout = self.output_layout
        module.use_local_output = self.use_local_output
        return module


class VocabParallelEmbeddingModule(nn.Embedding):
    """An ``nn.Embedding`` after :class:`VocabParallelEmbedding`: this rank's vocabulary rows only.

    Not built directly: the style turns an ``nn.Embedding`` into one (its parameters and state-dict
    keys stay those of the ``nn.Embedding``). Attributes set by the style: ``tp_mesh``,
    ``vocab_start`` / ``vocab_end`` (this rank's rows of the global vocabulary), ``output_layout``
    and ``use_local_output``.
    """

    tp_mesh: DeviceMesh
    vocab_start: int
    vocab_end: int
    output_layout: Placement
    use_local_output: bool

    def forward(self, tokens: Tensor) -> Tensor:
        """Embeddings of ``tokens`` (any shape, integer ids) ``[*tokens.shape, H]`` in ``output_layout``."""
        if isinstance(tokens, DTensor):
            tokens = tokens.full_tensor()
        weight = self.weight
        # The local rows as a plain tensor: the lookup, and so its backward, stay within them.
        # to_local's backward hands the [V / TP, H] gradient back as a DTensor of the weight's layout.
        local_weight = weight.to_local() if isinstance(weight, DTensor) else weight
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local_ids = (tokens - self.vocab_start).masked_fill_(outside, 0)
        padding_idx = self.padding_idx
        if padding_idx is not None:
            padding_idx = padding_idx - self.vocab_start if self.vocab_start <= padding_idx < self.vocab_end else None
        out = F.embedding(local_ids, local_weight, padding_idx)
        # In place: the lookup's backward keeps the ids, not its output; the mask's backward zeroes
        # those rows' gradient, so the row the outside ids were mapped to receives nothing from them.
        out = out.masked_fill_(outside.unsqueeze(-1), 0.0)
        partial = DTensor.from_local(out, self.tp_mesh, (Partial(),), run_check=False)
        output = partial.redistribute(placements=(self.output_layout,), async_op=True)
        return output.to_local() if self.use_local_output else output

    def extra_repr(self) -> str:
        """``nn.Embedding``'s description with this rank's vocabulary rows."""
        return f"{super().extra_repr()}, vocab_rows=[{self.vocab_start}, {self.vocab_end})"
