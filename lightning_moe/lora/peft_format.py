"""Adapters in PEFT's directory format: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT applies a LoRA adapter to a ``transformers`` model by module name: a linear layer ``M`` gets
``base_model.model.M.lora_A.weight`` ``[r, in]`` and ``lora_B.weight`` ``[out, r]`` (listed in
``target_modules``). The routed experts of ``transformers`` 5 are two 3-D parameters of the
``mlp.experts`` module, ``gate_up_proj`` ``[E, 2F, H]`` (gate rows, then up rows) and
``down_proj`` ``[E, H, F]``, which PEFT adapts through ``target_parameters``: one ``lora_A``
``[E * r, in]`` (expert ``e``'s rows ``e * r ... e * r + r - 1``) and one ``lora_B`` ``[out, r * E]``
(expert ``e``'s column ``k`` at ``k * E + e``) per parameter, the wrapper of the first listed
parameter nested inside the second's (its keys carry ``base_layer``). Both scale by
``lora_alpha / r``, as :class:`~lightning_moe.lora.LoRAConfig` does, so an adapter maps exactly:

* a linear adapter keeps its ``A``; its ``B`` goes where the base weight's rows go
  (:func:`~lightning_moe.models.hf.weights.hf_pieces`; a module whose rows are split over
  several Hugging Face modules gives each its rows of ``B`` and the whole ``A``);
* the experts' ``fc1_lora_A`` ``[E, r, H]`` and ``fc2_lora_A`` ``[E, r, F]`` are flattened,
  ``fc1_lora_B`` ``[E, 2F, r]`` and ``fc2_lora_B`` ``[E, H, r]`` are permuted to ``[out, r, E]``.

PEFT refuses dropout on 3-D parameters, so an adapter with expert targets is written with
``lora_dropout`` 0 (dropout only acts in training). Families whose experts ``transformers`` stores
otherwise (transposed or with interleaved gate/up columns) are refused by name.

Not expressible: adapters on MLP linears named ``gate_proj`` / ``up_proj`` / ``down_proj`` (shared
experts, dense layers; Mixtral's ``w1`` / ``w3`` / ``w2``). PEFT (0.21) reads those names in the
``target_modules`` of a ``transformers`` 5 MoE model as the routed experts of older checkpoints
and re-targets them at the fused expert parameters, so such an adapter would load onto the wrong
weights; they are refused (export the merged model instead).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_moe.lora.config import LoRAConfig
from lightning_moe.models.config import MoETransformerConfig
from lightning_moe.models.hf.registry import family as _family

__all__ = ["PEFT_CONFIG_NAME", "PEFT_WEIGHTS_NAME", "peft_adapter"]

PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # listed in this order: gate_up_proj's wrapper is the inner one
_EXPERT_KEY = re.compile(r"layers\.(\d+)\.ffn\.experts\.(fc[12])_lora_([AB])")
_LINEAR_KEY = re.compile(r"(.+)\.lora_([AB])")
# Linear names PEFT re-targets at the fused experts of a transformers 5 MoE model (module docstring).
_PEFT_REMAPPED_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def _expert_tensors(layer: str, fc: str, a: Tensor, b: Tensor) -> dict[str, Tensor]:
    experts, rank = a.shape[0], a.shape[1]
    b = b.reshape(experts, -1, rank)  # a gated fc1's [E, 2, F, r] state-dict view: gate rows, then up rows
    module = f"{_PEFT_PREFIX}model.layers.{layer}.mlp.experts." + ("base_layer." if fc == "fc1" else "")
    return {
        module + "lora_A.weight": a.reshape(experts * rank, a.shape[-1]).contiguous(),
        module + "lora_B.weight": b.permute(1, 2, 0).reshape(b.shape[1], rank * experts).contiguous(),
    }


def _linear_tensors(module: str, a: Tensor, b: Tensor, config: MoETransformerConfig, family: str,
                    unmapped: list[str], remapped: list[str]) -> dict[str, Tensor]:
    from lightning_moe.models.hf.weights import hf_pieces  # safetensors-free, but reads the family registry

    try:
        pieces = hf_pieces(module + ".weight", b, config, family)
    except (KeyError, ValueError):
        pieces = {}
    names = [name for name in pieces if name.endswith(".weight")]
    if not names or sum(pieces[name].shape[0] for name in names) != b.shape[0]:
        unmapped.append(module)
        return {}
    if any(name.rsplit(".", 2)[-2] in _PEFT_REMAPPED_NAMES for name in names):
        remapped.append(module)
        return {}
    out = {}
    for name in names:
        target = _PEFT_PREFIX + name[: -len(".weight")]
        out[target + ".lora_A.weight"] = a.clone()  # one copy per module: safetensors refuses shared storage
        out[target + ".lora_B.weight"] = pieces[name].reshape(-1, b.shape[1]).contiguous()
    return out


def peft_adapter(
    adapters: Mapping[str, Tensor], config: MoETransformerConfig, lora: LoRAConfig, family: str,
    base: str | None = None,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(adapter_config, tensors)`` of PEFT's format for our adapter state dict ``adapters``.

    Args:
        adapters: the adapter entries of a :class:`~lightning_moe.models.MoETransformer` state dict
            (``layers.{i}.attn.q_proj.lora_A``, ``layers.{i}.ffn.experts.fc1_lora_B``, ...), whole tensors.
        config: the model's configuration.
        lora: the adapters' configuration (rank, alpha, dropout).
        family: the Hugging Face ``model_type`` the adapters will be applied to.
        base: ``base_model_name_or_path`` (where the base model is), or None.

    Raises:
        ValueError: the family stores experts in another layout, or adapters sit on modules that
            have no Hugging Face counterpart (named).
    """
    pairs: dict[tuple[str, ...], dict[str, Tensor]] = {}
    for key, value in adapters.items():
        match = _EXPERT_KEY.fullmatch(key)
        if match:
            pairs.setdefault(("experts", match.group(1), match.group(2)), {})[match.group(3)] = value
            continue
        match = _LINEAR_KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"{key!r} is not an adapter key of this package (lora_A/lora_B, fc1_lora_A ...).")
        pairs.setdefault(("linear", match.group(1)), {})[match.group(2)] = value
    experts = any(kind[0] == "experts" for kind in pairs)
    if experts and _family(family).moe_sources is not None:
        # A family with its own expert sources (GPT-OSS: transposed, gate/up interleaved) is not [E, out, in].
        raise ValueError(f"PEFT export of expert adapters for {family!r} is not supported: transformers stores its "
                         "experts in another layout (transposed, gate and up interleaved). Export the merged model "
                         "instead (export --merge).")
    tensors: dict[str, Tensor] = {}
    unmapped: list[str] = []
    remapped: list[str] = []
    modules: set[str] = set()
    for kind, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {'.'.join(kind[1:])} has only lora_{''.join(pair)}: the state dict is incomplete; "
                             "pass every adapter entry of the checkpoint (lora_A and lora_B of each module).")
        a, b = (pair["A"].detach().cpu(), pair["B"].detach().cpu())
        if kind[0] == "experts":
            tensors.update(_expert_tensors(kind[1], kind[2], a, b))
        else:
            mapped = _linear_tensors(kind[1], a, b, config, family, unmapped, remapped)
            modules.update(name[len(_PEFT_PREFIX):-len(".lora_A.weight")] for name in mapped if name.endswith("lora_A.weight"))
            tensors.update(mapped)
    if unmapped:
        raise ValueError(f"adapters on {unmapped[:6]} have no {family!r} module PEFT could apply them to; train without "
                         "these targets or export the merged model (export --merge).")
    if remapped:
        raise ValueError(f"adapters on {remapped[:6]} cannot be written for PEFT: PEFT reads target_modules named "
                         f"{'/'.join(_PEFT_REMAPPED_NAMES[:3])} in a transformers MoE model as its routed experts and "
                         "would load them onto the expert weights. Export the merged model (export --merge), or "
                         "train with targets that leave out shared_expert (in LoRAConfig's default targets) and the "
                         "dense MLPs, e.g. targets: [experts, q_proj, k_proj, v_proj, o_proj].")
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": int(lora.rank), "lora_alpha": float(lora.alpha), "lora_dropout": 0.0 if experts else float(lora.dropout),
        "target_modules": sorted(modules), "target_parameters": [f"mlp.experts.{p}" for p in _EXPERT_PARAMETERS] if experts else None,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
        "alpha_pattern": {},
    }
    return adapter_config, {name: value.to(torch.float32) if value.dtype == torch.float64 else value
                            for name, value in tensors.items()}
