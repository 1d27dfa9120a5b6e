"""Tiny Hugging Face model directories for tests (``examples/make_tiny_hf_model.py`` as a module)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["REPO", "random_hf_model", "tiny_models"]

REPO = Path(__file__).resolve().parents[2]


def tiny_models():
    """``examples/make_tiny_hf_model.py`` as a module: ``make_tiny_model(path, family, texts=...)``,
    ``tiny_config``, ``train_tokenizer``."""
    spec = importlib.util.spec_from_file_location("make_tiny_hf_model", REPO / "examples" / "make_tiny_hf_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_hf_model(config, seed: int = 0):
    """``transformers``' causal LM of ``config``, random (``seed``), in eval mode, with the norms and
    DeepSeek's score-correction bias moved off their constant starts (so a wrong mapping shows)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # norms start at ones
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))
    return model
