"""Tiny Hugging Face model directories for tests (``examples/make_tiny_hf_model.py`` as a module)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["REPO", "tiny_models"]

REPO = Path(__file__).resolve().parents[2]


def tiny_models():
    """``examples/make_tiny_hf_model.py`` as a module: ``make_tiny_model(path, family, texts=...)``,
    ``tiny_config``, ``train_tokenizer``."""
    spec = importlib.util.spec_from_file_location("make_tiny_hf_model", REPO / "examples" / "make_tiny_hf_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
