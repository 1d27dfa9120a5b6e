"""``lightning-moe generate CKPT --prompt TEXT``: continue a prompt with a trained checkpoint, one process.

    lightning-moe generate logs/lightning_logs/version_0/checkpoints/last.ckpt --prompt "def main("
    lightning-moe generate CKPT --prompt "import" --temperature 0.8 --top_k 40 --seed 1 --max_new_tokens 200

CKPT is a :class:`~lightning_moe.lit.MoELanguageModel` checkpoint of any layout: a sharded
``MoEStrategy`` directory written at any TP/EP/ETP/PP size and sharding strategy, or a consolidated
file. It is read as ``lightning-moe export`` reads it
(:func:`~lightning_moe.checkpoint.export.read_checkpoint`: completeness and checksums
checked, nothing executed), into one :class:`~lightning_moe.models.MoETransformer` of the recorded
configuration, in this process, without a process group.

The prompt is encoded with the run's tokenizer: the one the checkpoint's
:class:`~lightning_moe.lit.TextDataModule` hyperparameters record (``data.tokenizer``, a Hugging
Face ``tokenizer.json`` or the directory holding it; the byte tokenizer when it is None), or
``--tokenizer``. Generation is greedy by default (``--temperature 0``), sampled otherwise, with
``--seed`` for a reproducible draw (:func:`~lightning_moe.models.generation.generate_tokens`); it
stops after ``--max_new_tokens`` or at the tokenizer's end-of-document token. The continuation
(without the prompt, without the end-of-document token) is printed to stdout.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from jsonargparse import ArgumentParser

from lightning_moe.checkpoint.export import read_checkpoint
from lightning_moe.checkpoint.export_hf import recorded_config
from lightning_moe.checkpoint.integrity import CheckpointIntegrityError
from lightning_moe.checkpoint.security import UnsafeCheckpointError
from lightning_moe.data import ByteTokenizer, HFTokenizer
from lightning_moe.data.token_check import TokenIdError, check_token_ids
from lightning_moe.models import MoETransformer
from lightning_moe.models.generation import generate_tokens

__all__ = ["GENERATE_HELP", "Generated", "generate_main", "generate_parser", "load_checkpoint_model", "run_tokenizer"]

GENERATE_HELP = "Continue a prompt with a MoELanguageModel checkpoint (any layout), greedy or sampled, in one process."
_PROG = "lightning-moe generate"
_MODEL_PREFIX = "model."
# What a user can fix from the message alone: reported in one line, without a traceback.
_ERRORS = (OSError, ValueError, RuntimeError, CheckpointIntegrityError, UnsafeCheckpointError, ImportError)


@dataclass(frozen=True)
class Generated:
    """What :func:`generate_main` generated."""

    prompt_ids: list[int]
    """The prompt's token ids."""
    new_ids: list[int]
    """The generated ids (the end-of-document id last, if generation stopped there)."""
    text: str
    """The decoded continuation (without the prompt and the end-of-document token), as printed."""


def generate_parser() -> ArgumentParser:
    """The parser of ``lightning-moe generate``."""
    parser = ArgumentParser(
        prog=_PROG,
        description=(
            f"{GENERATE_HELP} CKPT is a sharded MoEStrategy checkpoint directory or a consolidated checkpoint file of "
            "lightning_moe.lit.MoELanguageModel; the prompt is encoded with the run's tokenizer (recorded in the "
            "checkpoint's data hyperparameters, or --tokenizer). The continuation is printed to stdout."
        ),
    )
    parser.add_argument("checkpoint", metavar="CKPT", type=str, help="The checkpoint directory or file.")
    parser.add_argument("--prompt", type=str, required=True, help="The text to continue.")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="Tokens to generate at most.")
    parser.add_argument(
        "--temperature", type=float, default=0.0,
        help="0 = greedy (the most likely token each time); > 0 samples from softmax(logits / T).",
    )
    parser.add_argument("--top_k", type=int, default=None, help="Sample among the k most likely tokens only (null: all).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the sampling generator: the same seed, the same text.")
    parser.add_argument(
        "--tokenizer", type=str, default=None,
        help="A tokenizer.json (or the directory holding it) to use instead of the run's; 'byte' = the byte tokenizer.",
    )
    parser.add_argument("--ignore_eos", action="store_true", help="Do not stop at the end-of-document token.")
    parser.add_argument("--device", type=str, default="cpu", help="Where the model runs (cpu, cuda, ...).")
    parser.add_argument(
        "--no-verify", dest="no_verify", action="store_true",
        help="Skip the SHA-256 check of every shard (completeness and sizes are still checked).",
    )
    return parser


def run_tokenizer(extras: dict[str, Any], override: str | None = None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a run: ``override`` (a ``tokenizer.json`` path, or ``"byte"``), else the one the
    checkpoint's ``datamodule_hyper_parameters`` record (``tokenizer`` and ``tokenizer_eos_token`` of
    :class:`~lightning_moe.lit.TextDataModule`), else the byte tokenizer."""
    data = extras.get("datamodule_hyper_parameters") or {}
    if override == "byte":
        return ByteTokenizer()
    path = override if override is not None else data.get("tokenizer")
    if path is None:
        return ByteTokenizer()
    if not Path(path).exists():
        raise FileNotFoundError(
            2, f"The run's tokenizer {path} does not exist here (a path relative to where training ran?); pass "
            "--tokenizer PATH to its tokenizer.json or model directory",
        )
    return HFTokenizer(path, None if override is not None else data.get("tokenizer_eos_token"))


def load_checkpoint_model(
    checkpoint: str | Path, verify: bool = True, device: str | torch.device = "cpu"
) -> tuple[MoETransformer, dict[str, Any]]:
    """``(model, extras)``: the :class:`MoETransformer` of a ``MoELanguageModel`` checkpoint of any layout,
    in eval mode on ``device``, and what else the checkpoint records (hyperparameters, with the
    data module's). One process; the whole model in memory once."""
    source = Path(checkpoint)
    state, _, _, _, extras = read_checkpoint(source, verify=verify)
    config = recorded_config(extras, source)
    weights = {key[len(_MODEL_PREFIX):]: value for key, value in state.items() if key.startswith(_MODEL_PREFIX)}
    if not weights:
        raise ValueError(f"{source} holds no 'model.*' weights: it is not a MoELanguageModel checkpoint.")
    model = MoETransformer(config)
    model.load_state_dict(weights, strict=True)
    return model.to(device).eval(), extras


def generate_main(args: list[str]) -> Generated:
    """``lightning-moe generate ARGS``: generate, print the continuation; a failure exits with status 1
    and a one-line message (usage errors with 2)."""
    options = generate_parser().parse_args(args)
    try:
        model, extras = load_checkpoint_model(options.checkpoint, verify=not options.no_verify, device=options.device)
        tokenizer = run_tokenizer(extras, options.tokenizer)
        prompt = list(tokenizer.encode(options.prompt))
        if not prompt:
            raise ValueError("--prompt encodes to no tokens; give a non-empty prompt.")
        check_token_ids(
            torch.tensor(prompt), model.config.vocab_size, "the prompt",
            hint="The tokenizer is not the one this model was trained with; pass the run's with --tokenizer.",
        )
        new = generate_tokens(
            model, prompt, options.max_new_tokens, temperature=options.temperature, top_k=options.top_k,
            seed=options.seed, eos_id=None if options.ignore_eos else tokenizer.eos_id,
            max_seq_len=model.config.max_seq_len, device=options.device,
        )
    except (*_ERRORS, TokenIdError) as err:
        text = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        print(f"{_PROG}: error: {' '.join(text.split())}", file=sys.stderr)
        raise SystemExit(1) from err
    shown = new[:-1] if new and new[-1] == tokenizer.eos_id and not options.ignore_eos else new
    # A model's vocabulary is often padded past the tokenizer's: such ids have no text.
    text = tokenizer.decode([t for t in shown if t < tokenizer.vocab_size])
    print(text)
    return Generated(prompt_ids=prompt, new_ids=new, text=text)
