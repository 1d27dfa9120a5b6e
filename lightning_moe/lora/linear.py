"""`LoRALinear`: an ``nn.Linear`` with a low-rank adapter (attention projections, shared experts, users' layers).

A subclass of ``nn.Linear`` made in place from one (:meth:`LoRALinear.convert`), so everything that
recognises linear layers keeps doing so: the reference model's initialisation and its
tensor-parallel plan (torch's ``ColwiseParallel`` / ``RowwiseParallel`` shard ``lora_A`` and
``lora_B`` along with the weight, and DTensor keeps the adapter's product exact), sharded data
parallelism, FP8 exclusions by name. Parameters: the frozen ``weight`` (and ``bias``), ``lora_A``
``[r, in]`` and ``lora_B`` ``[out, r]``; output ``x W^T + b + alpha/r * (dropout(x) A^T) B^T``.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import Replicate

from lightning_moe.layers.experts import expert_generator
from lightning_moe.layers.weight_init import write_full

__all__ = ["LoRALinear", "name_seed"]


def name_seed(seed: int, name: str) -> int:
    """A seed for module ``name`` (stable across processes and Python runs, unlike ``hash``)."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**62)


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus ``alpha/r * B @ A`` (module docstring)."""

    lora_scale: float
    lora_dropout: float
    lora_seed: int

    @classmethod
    def convert(cls, linear: nn.Linear, rank: int, scale: float, dropout: float, seed: int) -> LoRALinear:
        """Turn ``linear`` (a plain ``nn.Linear``) into an adapted one, in place; returns it."""
        if type(linear) is not nn.Linear:
            raise TypeError(
                f"LoRA adapts plain torch.nn.Linear modules; got {type(linear).__name__}. Leave it out of "
                "LoRAConfig.targets."
            )
        linear.__class__ = cls
        linear.lora_scale, linear.lora_dropout, linear.lora_seed = float(scale), float(dropout), int(seed)
        factory = {"device": linear.weight.device, "dtype": torch.float32}
        linear.lora_A = nn.Parameter(torch.empty(rank, linear.in_features, **factory))
        linear.lora_B = nn.Parameter(torch.empty(linear.out_features, rank, **factory))
        if not linear.weight.is_meta:
            linear.reset_adapter_parameters()
        return linear

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation of the weight, then the adapter's (materialising a meta model)."""
        super().reset_parameters()
        if "lora_A" in self._parameters:
            self.reset_adapter_parameters()

    @torch.no_grad()
    def reset_adapter_parameters(self) -> None:
        """``A`` uniform in ``±1/sqrt(in)`` from ``lora_seed`` (drawn in full, this rank's slice kept), ``B`` zero."""
        bound = 1.0 / math.sqrt(self.in_features)
        gen = expert_generator(self.lora_seed, 0)
        values = torch.empty(self.lora_A.shape, device="cpu").uniform_(-bound, bound, generator=gen)
        write_full(self.lora_A, values)
        self.lora_B.zero_()

    def forward(self, x: Tensor) -> Tensor:
        """The frozen layer plus the adapter's update (module docstring)."""
        weight = self.weight
        if not torch.is_autocast_enabled(x.device.type) and weight.dtype != x.dtype:
            weight = weight.to(x.dtype)  # a base kept in a narrower dtype
        base = F.linear(x, weight, self.bias)
        a = F.dropout(x, self.lora_dropout, training=True) if self.lora_dropout and self.training else x
        placements = getattr(a, "placements", None)
        if placements is not None and getattr(self.lora_A, "placements", None) == tuple(Replicate() for _ in placements):
            # Row-parallel under tensor parallelism: the input is sharded on ``in`` and both factors are
            # whole (lightning_moe.parallel.tensor_parallel.place_linear_adapters); gather the input
            # so the adapter's product is one replicated term and never a partial sum of the rank.
            a = a.redistribute(a.device_mesh, self.lora_A.placements)
        a = F.linear(a, self.lora_A if self.lora_A.dtype == x.dtype else self.lora_A.to(x.dtype))
        update = F.linear(a, self.lora_B if self.lora_B.dtype == a.dtype else self.lora_B.to(a.dtype))
        return base + update * self.lora_scale

    @torch.no_grad()
    def merged_weight(self) -> Tensor:
        """``W + alpha/r * B @ A`` in the weight's dtype."""
        merged = self.weight.float() + self.lora_scale * (self.lora_B.float() @ self.lora_A.float())
        return merged.to(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.lora_A.shape[0]}, lora_scale={self.lora_scale}"
