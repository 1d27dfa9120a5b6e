"""Check a model against a parallel layout before any process exists.

:func:`~lightning_moe.parallel.parallelize` refuses a model that a layout cannot shard (experts
that do not split over EP, heads or widths that do not divide by TP), but only inside ``MoEStrategy.setup``, i.e. after every rank started and
joined its process groups, so the same error is printed once per rank. Those checks are pure
arithmetic on the model's configuration and :class:`~lightning_moe.parallel.ParallelDims`:
:func:`check_model_layout` runs them all in the launching process (the ``lightning-moe`` CLI does,
right after building the model and Trainer) and raises one :class:`LayoutError` listing every
problem.

:func:`meta_copy` makes the model to check without allocating it: a deep copy whose parameters
and buffers are meta tensors, with ``configure_model()`` run on it under the meta device (the
reference model builds its layers there). The original model, and the global RNGs its later
initialisation draws from, are left untouched.
"""

from __future__ import annotations

import copy
import random

import torch
from torch import nn

from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.moe import MoELayer
from lightning_moe.parallel.config_error import ConfigError, raise_problems
from lightning_moe.parallel.expert_support import expert_parallel_support_problem
from lightning_moe.parallel.layout.dims import ParallelDims
from lightning_moe.parallel.tensor_parallel import tensor_parallel_problems

__all__ = [
    "LayoutError",
    "check_model_layout",
    "expert_layer_problems",
    "layout_problems",
    "meta_copy",
]


class LayoutError(ConfigError):
    """The model cannot be sharded on the requested parallel layout (every reason in the message)."""


def meta_copy(module: nn.Module, configure: bool = True) -> nn.Module:
    """A deep copy of ``module`` with every parameter and buffer on the meta device.

    With ``configure``, the copy's ``configure_model()`` (Lightning's hook, if the module has one)
    runs under ``torch.device("meta")``, so layers built there exist too. Torch's CPU RNG and
    Python's ``random`` are restored afterwards: building a ``MoELayer`` draws its seed from the
    CPU generator, and the real model must draw the same seeds later. Errors of the copy or of
    ``configure_model`` propagate.
    """
    memo: dict[int, object] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) not in memo:
            meta = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(
                tensor, nn.Parameter
            ) else meta
    python_rng = random.getstate()
    with torch.random.fork_rng(devices=[]):
        try:
            probe = copy.deepcopy(module, memo)
            configure_model = getattr(probe, "configure_model", None)
            if configure and callable(configure_model):
                with torch.device("meta"):
                    configure_model()
        finally:
            random.setstate(python_rng)
    return probe


def expert_layer_problems(config: MoEConfig, dims: ParallelDims) -> list[str]:
    """Every reason a MoE layer of ``config`` cannot be sharded over the EP and ETP sizes of ``dims``.

    The one source of these checks: experts over EP, the expert FFN over ETP (``[]`` if none
    applies). ``apply_expert_parallel`` raises the first, :func:`layout_problems` lists them all.
    """
    problems = []
    try:
        dims.validate_num_experts(config.num_experts)
    except ValueError as err:
        problems.append(str(err))
    if config.ffn_hidden_size % dims.etp:
        problems.append(
            f"ffn_hidden_size={config.ffn_hidden_size} is not divisible by the expert tensor parallel "
            f"size {dims.etp}; choose an ETP size that divides it."
        )
    # Neither bias needs a rule: ETP cuts fc1_bias with fc1's columns (each rank adds its own block)
    # and fc2_bias is added by one ETP rank only (apply_expert_parallel).
    return problems


def layout_problems(model: nn.Module, dims: ParallelDims) -> list[str]:
    """Every reason :func:`~lightning_moe.parallel.parallelize` would refuse ``model`` on ``dims``.

    :func:`~lightning_moe.parallel.expert_support.expert_parallel_support_problem` (MoE blocks that
    are not ``MoELayer`` s under EP), :func:`expert_layer_problems` of every MoE layer,
    and the ``tensor_parallel`` checks of every model plan (the reference model's: vocabulary, heads
    and FFN over TP); one entry per distinct problem.
    """
    problems: list[str] = []
    no_experts = expert_parallel_support_problem(model, dims)
    if no_experts is not None:
        problems.append(no_experts)
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            problems.extend(p for p in expert_layer_problems(layer.config, dims) if p not in problems)
    if dims.tp > 1:
        problems.extend(p for p in tensor_parallel_problems(model, dims.tp) if p not in problems)
    return problems


def check_model_layout(model: nn.Module, dims: ParallelDims) -> None:
    """Raise :class:`LayoutError` with every problem of :func:`layout_problems`, if any."""
    raise_problems(LayoutError, f"The model cannot be sharded on {dims.describe()}", layout_problems(model, dims))
