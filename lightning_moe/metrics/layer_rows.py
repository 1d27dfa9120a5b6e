"""The whole model's numbering of the MoE layers, on the ranks of a model split into pipeline stages.

Without pipeline parallelism :func:`~lightning_moe.metrics.moe_layers` numbers a model's MoE layers
in ``modules()`` order: row ``i`` of :class:`~lightning_moe.metrics.ExpertLoadMetric` and the
logged ``layer_<i>`` names. Under pipeline parallelism each rank holds only its stages' blocks,
kept under their global names (the trimmed blocks' ``nn.ModuleDict`` is keyed by the original
indices, ``model.layers.5``: :mod:`lightning_moe.parallel.pipeline.split`), so its own layers
would be numbered from 0 within the stage. :func:`global_layer_rows` gives each of this rank's
layers its number in the whole model instead: every rank reads its layers' positions from their
names, the positions are gathered over the pipeline group and sorted, and a layer's row is its
place in that order, which is the unsplit model's ``modules()`` order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from lightning_moe.layers.moe import MoELayer

__all__ = ["global_layer_rows", "module_position"]


def module_position(root: nn.Module, name: str) -> tuple[int, ...]:
    """Where the submodule ``name`` of ``root`` sits in the unsplit model: one number per level of its name.

    A child named by digits (``nn.ModuleList``, ``nn.Sequential``, the pipeline's trimmed blocks'
    ``nn.ModuleDict``) is placed by that number (its index in the whole model, which the trimmed
    container still carries), any other child by its registration order among its parent's
    children (which a pipeline trim keeps: dropped pieces stay registered as None). Sorting the
    positions of a model's modules gives their ``modules()`` order (a depth-first walk in
    registration order).
    """
    position, parent = [], root
    for part in name.split(".") if name else ():
        children = parent._modules  # every child slot, the None ones included (nn.Module has no public view)
        if part not in children:
            raise KeyError(f"{type(parent).__name__} has no child {part!r} (looking up {name!r}).")
        position.append(int(part) if part.isdigit() else list(children).index(part))
        parent = children[part]
    return tuple(position)


def global_layer_rows(
    root: nn.Module, layers: Sequence[MoELayer], group: dist.ProcessGroup
) -> tuple[list[int], list[int]]:
    """Rows of this rank's ``layers`` in the whole model, and ``num_experts`` of every layer of the model.

    ``layers`` are this rank's MoE layers (``moe_layers(root)``; none on a stage of dense blocks
    only). A collective over ``group`` (the ``pp`` group: one ``all_gather_object``): every rank
    of it must call it, each with its own layers. Returns ``(rows, num_experts)``: ``rows[i]`` is
    the row of ``layers[i]``, ``num_experts[r]`` the expert count of the model's layer of row
    ``r`` (the same list on every rank). Raises ``ValueError`` (on every rank) when several ranks
    hold the same layer (a model that was not trimmed to its stages).
    """
    names = {id(module): name for name, module in root.named_modules()}
    local: list[tuple[tuple[int, ...], int, str]] = []  # (position, num_experts, name) of each layer
    for layer in layers:
        name = names[id(layer)]
        local.append((module_position(root, name), layer.config.num_experts, name))
    gathered: list[list] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(gathered, local, group=group)
    everything = sorted(entry for rank_entries in gathered for entry in rank_entries)
    positions = [position for position, _, _ in everything]
    if len(set(positions)) != len(positions):
        owners: dict[str, list[int]] = {}
        for rank, rank_entries in enumerate(gathered):
            for _, _, name in rank_entries:
                owners.setdefault(name, []).append(rank)
        shared = ", ".join(f"{name} on ranks {ranks}" for name, ranks in owners.items() if len(ranks) > 1)
        raise ValueError(
            f"The same MoE layers are held by several pipeline ranks ({shared}): each rank must hold only "
            "its own stages' layers (the pipeline split trims the model to them)."
        )
    rows = [positions.index(position) for position, _, _ in local]
    return rows, [experts for _, experts, _ in everything]
