"""`load_hf_weights`: a Hugging Face directory into a parallelised model, each rank reading its slices.

Oracle: the single-device ``MoETransformer.from_pretrained`` of the same directory (itself checked
against ``transformers`` in ``tests/models/test_hf_families.py``) and ``transformers``' logits. On 4
forked gloo ranks, a model built with *random* weights and parallelised at each layout, then
loaded, must hold bit for bit the one-device model's tensors in its global state dict, and its
forward must give ``transformers``' logits (fp32, 1e-5 of their scale). Layouts: EP=2 (EDP=2),
TP=2 x EP=4 folded (ETP=1), TP=2 x EP=2 x ETP=2 (gated fc1 blocks), each replicated and with
``FULL_SHARD`` (FSDP2 DTensors: dense 2-D over DP x TP, experts over EDP on H). Qwen3-MoE (GQA,
a dense layer), DeepSeek-V3 (MLA, shared expert, score bias), Qwen2-MoE (q/k/v biases, gated shared
expert) and GLM-4.5 (partial rotary, q/k norm, q/k/v biases, score bias). Each rank also reads at most its
share of the bytes (plus the replicated tensors): no rank reads the whole model. GPT-OSS (sinks,
sliding window, biases everywhere), with plain and MXFP4 experts, at the layouts without ETP and
``FULL_SHARD``: the MXFP4 experts cut over EP and over EDP on H, against ``transformers``'
dequantised model.
"""

from __future__ import annotations

import pytest
import torch
from helpers.asserts import assert_close_to_scale
from helpers.dist import run_distributed
from helpers.hf import tiny_models
from torch.distributed.tensor import DTensor

from lightning_moe.models import MoETransformer
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize

pytest.importorskip("transformers", reason="the test extra installs transformers")
pytest.importorskip("safetensors", reason="the hf and test extras install safetensors")

WORLD = 4
LOGITS_TOL = 1e-5
LAYOUTS = {"ep2": (1, 2, 1), "tp2-ep4-etp1": (2, 4, 1), "tp2-ep2-etp2": (2, 2, 2)}


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "qwen2_moe", "glm4_moe"])
def hf_dir(request, tmp_path_factory):
    """(directory, transformers model, probe tokens, their transformers logits)."""
    path = tmp_path_factory.mktemp(request.param)
    model = tiny_models().make_tiny_model(path, request.param, texts=["def f(x):\n    return x\n"] * 4)
    tokens = torch.randint(3, 320, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return path, tokens, logits


def _load(rank: int, world_size: int, path: str, layout: tuple[int, int, int], sharding: str, tokens) -> dict:
    from lightning_moe.checkpoint.hf_load import load_hf_weights

    tp, ep, etp = layout
    ctx = build_parallel_context(ParallelDims(world_size, tp=tp, ep=ep, etp=etp), "cpu")
    config = MoETransformer.from_pretrained(path).config  # the architecture only; the weights are re-drawn
    torch.manual_seed(100 + rank)
    model = MoETransformer(config)
    parallelize(model, ctx, sharding_strategy=sharding)
    read = load_hf_weights(model, path)
    state = model.state_dict()  # collective: the same order on every rank
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}
    with torch.no_grad():
        logits = model.full_logits(model.eval()(tokens))  # each TP rank's output is its vocabulary slice
    return {"state": full, "logits": logits, "bytes_read": read}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["NO_SHARD", "FULL_SHARD"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_rank_loads_its_slices(hf_dir, layout, sharding, tmp_path):
    path, tokens, expected_logits = hf_dir
    results = run_distributed(_load, WORLD, str(path), LAYOUTS[layout], sharding, tokens, tmp_dir=tmp_path, timeout_s=180)
    reference = MoETransformer.from_pretrained(path)
    expected = reference.state_dict()
    total = sum(t.numel() * t.element_size() for k, t in expected.items() if k != "lm_head.weight" or not reference.config.tie_embeddings)
    for rank, result in enumerate(results):
        assert sorted(result["state"]) == sorted(expected), rank
        for key, value in expected.items():
            got = result["state"][key]
            assert got.dtype == value.dtype and torch.equal(got, value), (rank, key)
        assert_close_to_scale(result["logits"], expected_logits, LOGITS_TOL, f"rank {rank} logits")
        assert 0 < result["bytes_read"] <= total, (rank, result["bytes_read"], total)
    if LAYOUTS[layout][1] > 1:  # experts sharded over EP: no rank reads everything
        assert all(r["bytes_read"] < total for r in results), [r["bytes_read"] for r in results]


def test_refuses_a_model_of_another_architecture(hf_dir, tmp_path):
    from lightning_moe.checkpoint.hf_load import load_hf_weights

    path, _, _ = hf_dir
    config = MoETransformer.from_pretrained(path).config
    wider = MoETransformer(type(config)(**{**config.__dict__, "vocab_size": config.vocab_size + 64}))
    with pytest.raises(ValueError, match=r"embed\.weight: the model's global shape is \(384, 32\)"):
        load_hf_weights(wider, path)


def test_refuses_a_meta_model(hf_dir):
    from lightning_moe.checkpoint.hf_load import load_hf_weights

    path, _, _ = hf_dir
    with torch.device("meta"):
        model = MoETransformer(MoETransformer.from_pretrained(path).config)
    with pytest.raises(RuntimeError, match="still on the meta device"):
        load_hf_weights(model, path)


@pytest.fixture(scope="module", params=["plain", "mxfp4"])
def gpt_oss_dir(request, tmp_path_factory):
    """(directory, probe tokens, transformers' logits) of a tiny GPT-OSS, its experts plain or MXFP4."""
    import transformers
    from helpers.gpt_oss import random_gpt_oss, write_mxfp4_directory

    path = tmp_path_factory.mktemp(f"gpt_oss_{request.param}")
    config = transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, max_position_embeddings=64, initializer_range=0.1,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=5, swiglu_limit=1.0,
    )
    model = random_gpt_oss(config, seed=1)
    model.save_pretrained(path)
    if request.param == "mxfp4":  # the oracle: transformers' model of the dequantised experts
        write_mxfp4_directory(path, path / "mxfp4")
        path = path / "mxfp4"
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return path, tokens, logits


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2", "tp2-ep4-etp1"])
def test_gpt_oss_each_rank_loads_its_slices(gpt_oss_dir, layout, tmp_path):
    # FULL_SHARD: the experts also cut over EDP on H, through MXFP4's groups of 32 columns. Not
    # tp2-ep2-etp2: GPT-OSS's expert down bias (fc2_bias) is refused under ETP > 1.
    path, tokens, expected_logits = gpt_oss_dir
    results = run_distributed(_load, WORLD, str(path), LAYOUTS[layout], "FULL_SHARD", tokens, tmp_dir=tmp_path,
                              timeout_s=180)
    expected = MoETransformer.from_pretrained(path).state_dict()
    for rank, result in enumerate(results):
        assert sorted(result["state"]) == sorted(expected), rank
        for key, value in expected.items():
            assert torch.equal(result["state"][key], value), (rank, key)
        assert_close_to_scale(result["logits"], expected_logits, LOGITS_TOL, f"rank {rank} logits")
    files = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert all(0 < r["bytes_read"] < files / 2 for r in results), ([r["bytes_read"] for r in results], files)
