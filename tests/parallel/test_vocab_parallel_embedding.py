"""The vocabulary-parallel embedding (`parallel/vocab_parallel_embedding.py`) equals ``nn.Embedding``.

Oracle: the single-device ``nn.Embedding`` with the same weight on the same ids and output
gradient, computed in the parent process. One launch of 2 gloo ranks runs every check: outputs
(sequence-sharded and replicated), the weight's gradient (and that each rank computes only its
``V / TP`` rows of it), a ``padding_idx``, ids outside the vocabulary (zero rows on every rank, as
torch's ``RowwiseParallel`` gave them; the Lightning module refuses such batches first), and the
output dtype under CPU bf16 autocast. The memory property at the real presets' sizes is in
``tests/scale/test_vocab_parallel_head.py``; here the same bound at a vocabulary larger than the
tokens of a batch.
"""

from __future__ import annotations

import pytest
import torch
from helpers.dist import run_distributed
from helpers.recorders import LargestTensor
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims, build_parallel_context
from lightning_moe.parallel.tensor_parallel import apply_tensor_parallel
from lightning_moe.parallel.vocab_parallel_embedding import VocabParallelEmbedding
from lightning_moe.planning.fake_world import fake_rank

VOCAB, HIDDEN, BATCH, SEQ, TP = 64, 4, 2, 8, 2  # VOCAB and SEQ divisible by TP; BATCH * SEQ < VOCAB / TP
PAD = 40  # a padding row in the second rank's half of the vocabulary
OUTSIDE = (VOCAB, VOCAB + 5, -1, -VOCAB - 1)  # past the end and negative (below every rank's range)
# Each output row is one weight row plus zeros from the other rank: exact. The weight gradient sums
# the same output-gradient rows per id in position order on both sides; the tolerance only admits
# a kernel that orders those sums differently.
GRAD_TOL = 1e-6
KWARGS = {"plain": {}, "padding_idx": {"padding_idx": PAD}}
LAYOUTS = {"sequence": Shard(1), "replicate": Replicate()}


def _reference(**kwargs) -> nn.Embedding:
    torch.manual_seed(0)
    return nn.Embedding(VOCAB, HIDDEN, **kwargs)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Ids over the whole vocabulary with repeats, some outside it; the output's gradient."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    tokens[0, :3] = torch.tensor([PAD, PAD, 3])  # a repeated padding id, a repeated ordinary id
    tokens[1, 1] = 3
    tokens[1, -len(OUTSIDE):] = torch.tensor(OUTSIDE)
    return tokens, torch.randn(BATCH, SEQ, HIDDEN, generator=gen)


def _lookups(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    tokens, grad_out = _batch()
    results = {}
    for name, kwargs in KWARGS.items():
        for layout_name, layout in LAYOUTS.items():
            module = _reference(**kwargs)
            parallelize_module(module, mesh, VocabParallelEmbedding(output_layout=layout))
            with LargestTensor() as forward:
                out = module(tokens)
            local_grad = grad_out.chunk(world, dim=1)[rank] if layout_name == "sequence" else grad_out
            with LargestTensor() as backward:
                out.to_local().backward(local_grad)
            grad = module.weight.grad
            results[(name, layout_name)] = {
                "placements": out.placements,
                "local shape": tuple(out.to_local().shape),
                "output": out.full_tensor().detach(),
                "grad placements": grad.placements,
                "grad local shape": tuple(grad.to_local().shape),
                "grad": grad.full_tensor(),
                "largest": max(forward.numel, backward.numel),
                "where": backward.where,
                "state": {k: (v.placements, tuple(v.shape)) for k, v in module.state_dict().items()},
            }
    with torch.autocast("cpu", dtype=torch.bfloat16):
        results["autocast dtype"] = module(tokens).dtype
    return results


@pytest.mark.distributed
def test_vocab_parallel_embedding_equals_nn_embedding(tmp_path):
    runs = run_distributed(_lookups, TP, tmp_dir=tmp_path)
    tokens, grad_out = _batch()
    inside = ((tokens >= 0) & (tokens < VOCAB)).unsqueeze(-1)
    # Largest tensor a rank may make: its rows of the weight gradient, or the batch's output gradient.
    bound = max(VOCAB // TP, BATCH * SEQ) * HIDDEN
    for rank, results in enumerate(runs):
        for name, kwargs in KWARGS.items():
            reference = _reference(**kwargs)
            # nn.Embedding raises on ids outside the vocabulary: the oracle looks up the others.
            expected = reference(tokens.clamp(0, VOCAB - 1)) * inside
            expected.backward(grad_out)
            for layout_name, layout in LAYOUTS.items():
                got = results[(name, layout_name)]
                where = f"rank {rank} {name} {layout_name}"
                assert got["placements"] == (layout,), where
                local_seq = SEQ // TP if layout_name == "sequence" else SEQ
                assert got["local shape"] == (BATCH, local_seq, HIDDEN), where
                torch.testing.assert_close(got["output"], expected.detach(), rtol=0, atol=0, msg=where)
                assert got["grad placements"] == (Shard(0),), where
                assert got["grad local shape"] == (VOCAB // TP, HIDDEN), where
                torch.testing.assert_close(got["grad"], reference.weight.grad, rtol=0, atol=GRAD_TOL, msg=where)
                assert got["largest"] <= bound, (where, got["where"])
                assert got["state"] == {"weight": ((Shard(0),), (VOCAB, HIDDEN))}, where
            if "padding_idx" in kwargs:
                assert not results[(name, "sequence")]["grad"][PAD].any(), f"rank {rank}: padding row"
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert results["autocast dtype"] == _reference()(tokens.clamp(0, VOCAB - 1)).dtype


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"max_norm": 1.0}, r"max_norm.*1\.0.*use the defaults"),
        ({"scale_grad_by_freq": True}, r"scale_grad_by_freq.*True.*use the defaults"),
        ({"sparse": True}, r"sparse.*True.*use the defaults"),
    ],
)
def test_options_that_need_the_whole_vocabulary_are_refused(option, match):
    with fake_rank(0, TP):
        mesh = init_device_mesh("cpu", (TP,))
        with pytest.raises(ValueError, match=match):
            parallelize_module(nn.Embedding(VOCAB, HIDDEN, device="meta", **option), mesh, VocabParallelEmbedding())


def test_modules_meshes_and_layouts_it_cannot_shard_are_refused():
    with pytest.raises(ValueError, match=r"output_layout must be Shard\(dim\) or Replicate\(\), got P"):
        VocabParallelEmbedding(output_layout=Partial())

    class Scaled(nn.Embedding):
        def forward(self, tokens):
            return super().forward(tokens) * 2

    with fake_rank(0, TP * 2):
        mesh = init_device_mesh("cpu", (TP,))
        with pytest.raises(TypeError, match=r"shards a torch.nn.Embedding, got Scaled.*RowwiseParallel"):
            parallelize_module(Scaled(VOCAB, HIDDEN, device="meta"), mesh, VocabParallelEmbedding())
        grid = init_device_mesh("cpu", (2, TP), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match=r"one-dimensional tensor-parallel mesh, got 2 .*'tp' dimension"):
            VocabParallelEmbedding()._apply(nn.Embedding(VOCAB, HIDDEN, device="meta"), grid)


def test_tensor_parallelism_refuses_a_tied_embedding_and_head():
    """The tensor-parallel plan shards the embedding and the head as two modules; a tied weight is
    refused before either is touched (as before this embedding had its own style)."""
    config = MoETransformerConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN * 8, num_layers=1, num_attention_heads=4,
        moe=MoEConfig(HIDDEN * 8, 16, 4, top_k=2), tie_embeddings=True,
    )
    with fake_rank(0, TP):
        with torch.device("meta"):
            model = MoETransformer(config)
        ctx = build_parallel_context(ParallelDims(TP, tp=TP), "cpu")
        with pytest.raises(ValueError, match=r"tie_embeddings=True is not supported with tensor parallel size 2.*untie"):
            apply_tensor_parallel(model, ctx)
        assert not isinstance(model.embed.weight, DTensor) and model.lm_head.weight is model.embed.weight
