"""Qwen2-MoE, GLM-4.5 and GPT-OSS models loaded into TP=2, EP=2 (with and without FSDP2), ETP=2, CP=2 and PP=2
layouts give ``transformers``' logits.

Oracle: ``transformers``' own model of each tiny directory (random weights, every norm and bias
moved off its start, written by its ``save_pretrained``): Qwen2-MoE with q/k/v biases and a
sigmoid-gated shared expert, GLM-4.5 with partial rotary (half of each head), q/k norm per head,
q/k/v biases and the sigmoid router, GPT-OSS with attention sinks, sliding-window (shorter than a
CP chunk pair) and full layers, q/k/v/o biases, the biased router and experts and the clamped
SwiGLU; and the same GPT-OSS directory with its experts stored as MXFP4, against ``transformers``'
dequantised model. On 2 forked gloo ranks a model with *random* weights is
parallelised, then filled by ``load_hf_weights`` (what ``init_from`` runs): under TP the q/k/v
biases are sharded with their weights (column-parallel), under EP the experts; its forward must give
``transformers``' logits (fp32, 1e-5 of their scale), under CP on this rank's chunks of the sequence.
Under PP (one decoder layer per stage, 2 micro-batches) the pipeline's evaluation losses must be the
cross-entropy of ``transformers``' logits on each micro-batch. Under TP, EP and PP each rank reads
less than the whole directory: only its slices, or its stage's tensors, and the slices assemble
bit for bit into the one-device ``from_pretrained`` model; under EP exactly the replicated tensors
and its half of every expert tensor (MXFP4 blocks and scales included), and with FSDP2's
``FULL_SHARD`` of the dense tensors added, every byte of the directory's parameters is read by
exactly one rank (buffers, such as GLM-4.5's score-correction bias, by every rank). Under ETP
each rank holds an F block of every expert (GPT-OSS's expert down bias whole, added by ETP rank 0).
"""

from __future__ import annotations

import pytest
import torch
from helpers.asserts import assert_close_to_scale
from helpers.dist import run_distributed
from helpers.gpt_oss import random_gpt_oss, write_mxfp4_directory
from helpers.hf import random_hf_model
from torch.distributed.tensor import DTensor

from lightning_moe.models import MoETransformer
from lightning_moe.models.transformer import next_token_loss
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
pytest.importorskip("safetensors", reason="the hf and test extras install safetensors")

pytestmark = pytest.mark.distributed

WORLD, VOCAB, SEQ = 2, 64, 16  # SEQ divisible by TP and by 2 x CP
LOGITS_TOL = 1e-5
LAYOUTS = {"tp2": {"tp": 2, "etp": 1}, "ep2": {"ep": 2}, "etp2": {"etp": 2}, "cp2": {"cp": 2}, "pp2": {"pp": 2},
           "ep2-fsdp": {"ep": 2, "sharding": "FULL_SHARD"}}
MICRO = 2  # pipeline micro-batches


def _gpt_oss_config():
    # Sizes multiples of 32 (MXFP4 blocks); window 3 below the 4-token CP chunks, so the ring skips
    # blocks wholly outside it; a swiglu_limit the activations reach.
    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, max_position_embeddings=64, initializer_range=0.1,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=3, layer_types=["sliding_attention", "full_attention"],
        swiglu_limit=1.0, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
    )


def _hf_config(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, max_position_embeddings=64, initializer_range=0.1,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                  moe_intermediate_size=16, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, shared_expert_intermediate_size=24, num_experts=4,
                                           num_experts_per_tok=2, mlp_only_layers=[1])
    return transformers.Glm4MoeConfig(
        **common, head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        n_shared_experts=1, routed_scaling_factor=2.0, use_qk_norm=True, attention_bias=True,
        partial_rotary_factor=0.5, num_mtp_layers=0,
    )


@pytest.fixture(scope="module", params=["qwen2_moe", "glm4_moe", "gpt_oss", "gpt_oss-mxfp4"])
def hf_dir(request, tmp_path_factory):
    """(directory, probe tokens, their transformers logits)."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param.startswith("gpt_oss"):
        model = random_gpt_oss(_gpt_oss_config(), seed=3)
        model.save_pretrained(path)
        if request.param.endswith("mxfp4"):  # the oracle: transformers' model of the dequantised experts
            write_mxfp4_directory(path, path / "mxfp4")
            path = path / "mxfp4"
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    else:
        model = random_hf_model(_hf_config(request.param), seed=3)
        model.save_pretrained(path)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return path, tokens, logits


def _load_and_forward(rank: int, world_size: int, path: str, layout: dict, tokens) -> dict:
    from lightning_moe.checkpoint.hf_load import load_hf_weights
    from lightning_moe.parallel.context_parallel.apply import shard_batch

    layout = dict(layout)
    sharding = layout.pop("sharding", "NO_SHARD")
    ctx = build_parallel_context(ParallelDims(world_size, **layout), "cpu")
    config = MoETransformer.from_pretrained(path).config  # the architecture only; the weights are re-drawn
    torch.manual_seed(100 + rank)
    model = MoETransformer(config)
    if layout.get("pp", 1) > 1:
        return _pipeline(model, ctx, path, tokens)
    parallelize(model, ctx, sharding_strategy=sharding)
    bias = model.layers[0].attn.q_proj.bias
    bias_placements = [(type(p).__name__, getattr(p, "dim", None)) for p in bias.placements] if isinstance(
        bias, DTensor) else []
    read = load_hf_weights(model, path)
    state = model.state_dict()  # collective: the same order on every rank
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}
    with torch.no_grad():
        logits = model.full_logits(model.eval()(shard_batch(tokens, ctx)))
    return {"logits": logits, "bytes_read": read, "bias_placements": bias_placements, "state": full}


def _pipeline(model, ctx, path: str, tokens) -> dict:
    from lightning_moe.checkpoint.hf_load import load_hf_weights
    from lightning_moe.parallel.pipeline.runner import PipelineRunner

    runner = PipelineRunner(model, ctx, "1F1B", MICRO, next_token_loss, torch.device("cpu"))
    read = load_hf_weights(model, path)  # this stage's tensors
    losses = runner.eval_microbatches(tokens[:, :-1], tokens[:, 1:])
    return {"losses": losses, "bytes_read": read}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_equals_transformers(hf_dir, layout, tmp_path):
    from lightning_moe.parallel.context_parallel import shard_sequence

    path, tokens, expected = hf_dir
    results = run_distributed(_load_and_forward, WORLD, str(path), LAYOUTS[layout], tokens, tmp_dir=tmp_path,
                              timeout_s=120)
    files = _file_bytes(path)
    total = sum(files.values())
    model = MoETransformer.from_pretrained(path)
    reference = model.state_dict()
    for rank, result in enumerate(results):
        assert 0 < result["bytes_read"] <= total, (rank, result["bytes_read"], total)
        if layout == "pp2":  # the micro-batches' losses, from transformers' logits of the same rows
            with torch.no_grad():
                hf = transformers.AutoModelForCausalLM.from_pretrained(path, **_dequantised(path)).eval()
                logits = hf(input_ids=tokens[:, :-1]).logits
            want = torch.stack([next_token_loss(part, targets) for part, targets in
                                zip(logits.chunk(MICRO), tokens[:, 1:].chunk(MICRO))])
            torch.testing.assert_close(result["losses"], want, rtol=LOGITS_TOL, atol=0.0, msg=f"rank {rank}")
            assert result["bytes_read"] < total, (rank, result["bytes_read"], total)
            continue
        # Each rank's slices assemble bit for bit into the one-device model (MXFP4 blocks dequantised alike).
        assert sorted(result["state"]) == sorted(reference)
        for key, value in reference.items():
            assert torch.equal(result["state"][key], value), (rank, key)
        want = shard_sequence(expected, rank, WORLD, dim=1) if layout == "cp2" else expected
        assert_close_to_scale(result["logits"], want, LOGITS_TOL, f"{layout} rank {rank} logits")
        if layout == "tp2":  # the q/k/v biases are split over the heads, as their weights
            assert result["bias_placements"] == [("Shard", 0)], result["bias_placements"]
        if layout != "cp2":  # only this rank's slices of the sharded tensors are read
            assert result["bytes_read"] < total, (rank, result["bytes_read"], total)
        if layout == "ep2":  # the replicated tensors whole, half of each expert tensor (2 of 4 experts)
            experts = sum(size for name, size in files.items() if ".experts." in name)
            assert result["bytes_read"] == total - experts // 2, (rank, result["bytes_read"], total, experts)
    if layout == "ep2-fsdp":  # parameters sharded over EP or DP: each of their bytes read by exactly one rank
        replicated = sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name in reference)
        reads = [result["bytes_read"] for result in results]
        assert sum(reads) == total + (WORLD - 1) * replicated, (reads, total, replicated)


def _file_bytes(path) -> dict[str, int]:
    """The bytes of each tensor of the directory's safetensors files, as stored (MXFP4 packed)."""
    from safetensors.torch import load_file

    sizes = {}
    for file in sorted(path.glob("*.safetensors")):
        sizes.update({name: t.numel() * t.element_size() for name, t in load_file(file).items()})
    return sizes


def _dequantised(path) -> dict:
    """``from_pretrained`` keyword arguments making ``transformers`` dequantise an MXFP4 directory."""
    import json

    quantized = "quantization_config" in json.loads((path / "config.json").read_text())
    return {"quantization_config": transformers.Mxfp4Config(dequantize=True)} if quantized else {}
