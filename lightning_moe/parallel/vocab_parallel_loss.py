"""Vocabulary-parallel cross-entropy: the loss of logits that stay sharded over the vocabulary.

Under tensor parallelism the output head is column-parallel over the vocabulary, so each TP rank
computes the logits of its ``V / TP`` vocabulary entries for every token (the sequence is gathered
before the head). Gathering them to compute the loss would materialise ``tokens x V`` logits (and
their gradient) on every rank: 5 GB each at 8k tokens and Qwen3's 152k vocabulary in fp32.
Megatron Core's ``vocab_parallel_cross_entropy`` (``tensor_parallel/cross_entropy.py``) needs
only three reductions of one number per token over the TP group, done here in two collectives:

1. each rank's largest logit per token, all-reduced with ``MAX`` (the softmax's shift);
2. the shifted logit of the target, taken by the rank whose slice holds it (0 on the others), and
   each rank's sum of ``exp(logit - max)``, stacked and all-reduced with ``SUM``;
3. ``loss = log(sum_exp) - (target_logit - max)``, the same value on every rank of the group.

Backward needs no communication: the gradient of the loss with respect to this rank's logits is
``softmax - onehot(target)`` restricted to its columns (the softmax is kept from the forward pass),
times the incoming gradient. Arithmetic is fp32 whatever the logits' dtype (bf16 under autocast);
the gradient comes back in the logits' dtype. Targets equal to ``ignore_index`` give loss 0 and no
gradient. Target ids outside ``[0, V)`` are not checked here (it would cost a host read per step):
:meth:`lightning_moe.lit.MoELanguageModel.check_token_ids` refuses them.

:class:`VocabParallelLogits` is what tensor parallelism attaches to a
:class:`~lightning_moe.models.MoETransformer` whose head it shards
(:func:`~lightning_moe.parallel.tensor_parallel.apply_tensor_parallel`): the model's
:meth:`~lightning_moe.models.MoETransformer.loss_sum` and
:meth:`~lightning_moe.models.MoETransformer.full_logits` go through it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_moe.layers.expert_kernels import autocast_disabled

__all__ = ["VocabParallelLogits", "vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocabulary-sharded logits ``[N, V / TP]`` (module docstring)."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ignore_index: int, group) -> Tensor:
        with autocast_disabled(logits.device):  # the arithmetic stays fp32
            width = logits.shape[-1]
            start = dist.get_rank(group) * width  # group rank r holds columns [r * width, (r + 1) * width)
            shift = logits.amax(dim=-1).float()  # exact in any dtype
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
            # One fp32 buffer for the shifted logits, their exponentials and finally the softmax.
            probs = logits.to(torch.float32, copy=True).sub_(shift.unsqueeze(-1))
            kept = targets != ignore_index
            local = targets - start
            mine = kept & (local >= 0) & (local < width)
            index = torch.where(mine, local, 0).unsqueeze(-1)
            target_logit = probs.gather(-1, index).squeeze(-1) * mine
            sums = torch.stack([target_logit, probs.exp_().sum(dim=-1)])
            dist.all_reduce(sums, group=group)  # one collective for both sums
            target_logit, sum_exp = sums
            losses = torch.where(kept, sum_exp.log() - target_logit, 0.0)
            probs.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(probs, index, mine, kept)
        ctx.logits_dtype = logits.dtype
        ctx.backward_done = False
        return losses

    @staticmethod
    def backward(ctx, grad_losses: Tensor):
        if ctx.backward_done:  # the softmax was turned into the gradient in place
            raise RuntimeError(
                "vocab_parallel_cross_entropy cannot run backward twice through one forward "
                "(backward(retain_graph=True) and again): compute the loss again instead."
            )
        ctx.backward_done = True
        probs, index, mine, kept = ctx.saved_tensors
        grad = probs  # softmax - onehot(target), written over the saved softmax: no second buffer
        grad.scatter_add_(-1, index, -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_losses.float() * kept).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor, group, ignore_index: int = -100) -> Tensor:
    """Per-token fp32 cross-entropy ``[...]`` of this rank's vocabulary slice ``logits`` ``[..., V / TP]``.

    ``group`` is the tensor-parallel process group; group rank ``r`` holds vocabulary entries
    ``r * V / TP`` to ``(r + 1) * V / TP - 1`` (the layout of a column-parallel head). ``targets``
    ``[...]`` are global vocabulary ids, the same on every rank of the group; those equal to
    ``ignore_index`` give 0. Every rank returns the same losses, equal to
    ``F.cross_entropy(full_logits, targets, reduction="none")``; the gradient reaches only this
    rank's slice, without communication (module docstring).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy needs logits [..., V / TP] and targets [...] of the same leading "
            f"shape; got logits {tuple(logits.shape)} and targets {tuple(targets.shape)}."
        )
    flat = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index, group)
    return flat.view(targets.shape)


class VocabParallelLogits:
    """Logits of a column-parallel output head: this TP rank's slice of the vocabulary.

    Set by tensor parallelism as ``MoETransformer.vocab_parallel``; the model's loss and full logits
    go through it.

    Args:
        mesh: the one-dimensional tensor-parallel device mesh the head is sharded over.
        vocab_size: the whole vocabulary (a multiple of the mesh size).
    """

    def __init__(self, mesh: DeviceMesh, vocab_size: int) -> None:
        if vocab_size % mesh.size():
            raise ValueError(
                f"The vocabulary ({vocab_size} entries) does not split into {mesh.size()} equal tensor-parallel "
                f"slices; pad vocab_size to a multiple of {mesh.size()}."
            )
        self.mesh = mesh
        self.vocab_size = vocab_size

    def _check(self, logits: Tensor) -> None:
        width = self.vocab_size // self.mesh.size()
        if logits.shape[-1] != width:
            raise ValueError(
                f"Expected this rank's {width} of {self.vocab_size} vocabulary columns (TP={self.mesh.size()}), "
                f"got logits of shape {tuple(logits.shape)}; pass the model's own output, not gathered logits."
            )

    def loss_sum(self, logits: Tensor, targets: Tensor, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
        """``(fp32 sum of the cross-entropies, number of targets kept)`` of ``logits`` ``[B, S, V / TP]``
        against ``targets`` ``[B, S]``, as ``next_token_loss_sum`` of the full logits gives it."""
        self._check(logits)
        losses = vocab_parallel_cross_entropy(logits, targets, self.mesh.get_group(), ignore_index)
        return losses.sum(), (targets != ignore_index).sum()

    def gather(self, logits: Tensor) -> Tensor:
        """The full logits ``[..., V]`` from every rank's slice (an all-gather: for inference only)."""
        self._check(logits)
        return DTensor.from_local(logits, self.mesh, (Shard(logits.dim() - 1),), run_check=False).full_tensor()

    def __repr__(self) -> str:
        return f"VocabParallelLogits(vocab_size={self.vocab_size}, tp={self.mesh.size()})"
