"""Tiny GPT-OSS models for tests: ``transformers``' model with every bias and sink off its start, and
its directory rewritten with MXFP4 experts as the published checkpoints store them."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.hf import random_hf_model
from helpers.mxfp4 import quantize_mxfp4

__all__ = ["MXFP4_QUANTIZATION_CONFIG", "random_gpt_oss", "write_mxfp4_directory"]

MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
}
"""The ``quantization_config`` of openai/gpt-oss-20b and -120b's ``config.json``."""


def random_gpt_oss(config, seed: int = 0):
    """:func:`~helpers.hf.random_hf_model` of the ``GptOssConfig`` ``config``, with every bias (the
    experts' start at zero) and sink moved further (so a swapped or missing one shows)."""
    import torch

    model = random_hf_model(config, seed=seed)
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("_bias", ".bias", ".sinks")):
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return model


def write_mxfp4_directory(source: str | Path, target: str | Path) -> None:
    """Copy the Hugging Face directory ``source`` (one ``model.safetensors``) to ``target`` with every
    expert projection (``experts.gate_up_proj``, ``experts.down_proj``) as MXFP4 ``_blocks`` +
    ``_scales`` (:func:`~helpers.mxfp4.quantize_mxfp4`) and the published ``quantization_config``."""
    import safetensors.torch

    source, target = Path(source), Path(target)
    tensors = safetensors.torch.load_file(source / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales, _ = quantize_mxfp4(tensors.pop(name))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    target.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = MXFP4_QUANTIZATION_CONFIG
    (target / "config.json").write_text(json.dumps(config))
