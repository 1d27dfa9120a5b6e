"""`LoRAConfig`: which layers get low-rank adapters, of which rank and scale.

The adapters follow LoRA (Hu et al., 2021) as PEFT implements it: a frozen weight ``W`` of shape
``[out, in]`` is used as ``W + (alpha / rank) * B @ A`` with trainable ``A`` ``[rank, in]``
(uniform in ``±1/sqrt(in)``, PEFT's default) and ``B`` ``[out, rank]`` (zero, so the model is
unchanged before the first step); dropout, when set, applies to the adapter's input only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["BASE_DTYPES", "DEFAULT_TARGETS", "EXPERTS", "SHARED_EXPERT", "LoRAConfig"]

EXPERTS = "experts"
"""Target name of the routed experts: fc1 and fc2 of every ``GroupedExperts`` (one adapter per expert)."""
SHARED_EXPERT = "shared_expert"
"""Target name of the shared experts: fc1 and fc2 of every ``SharedExpertMLP`` (not its gate)."""
DEFAULT_TARGETS = (EXPERTS, SHARED_EXPERT, "q_proj", "k_proj", "v_proj", "o_proj")
"""The routed and shared experts and the attention projections of the reference model."""
BASE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Names ``base_dtype`` accepts."""


@dataclass
class LoRAConfig:
    """Low-rank adapters for a model with MoE layers (see :func:`lightning_moe.lora.apply_lora`).

    Args:
        rank: the adapters' rank r (>= 1).
        alpha: scale numerator: the update is ``alpha / rank * B @ A``.
        dropout: dropout probability on the adapters' input (0 keeps runs identical across layouts).
        targets: what gets adapters: ``"experts"`` (every routed expert's fc1 and fc2, stacked per
            expert), ``"shared_expert"`` (fc1 and fc2 of every shared expert), and name patterns of
            ``nn.Linear`` modules (``fnmatch``, matched against the module's full name and against its
            last component: ``"q_proj"`` or ``"layers.*.attn.q_proj"``).
        base_dtype: keep the frozen base weights of the adapted layers in this dtype
            (``"bfloat16"`` halves their memory); None leaves them as they are.
        seed: seed of the adapters' initial ``A`` (drawn per module name and global expert index,
            so every parallel layout starts from the same adapters).
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    base_dtype: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if int(self.rank) != self.rank or self.rank < 1:
            raise ValueError(f"LoRAConfig.rank must be a positive integer, got {self.rank!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got {self.dropout!r}.")
        if isinstance(self.targets, str):
            raise ValueError(f"LoRAConfig.targets must be a list of names, got the string {self.targets!r}; "
                             f"write [{self.targets!r}].")
        self.targets = list(self.targets)
        if not self.targets:
            raise ValueError(f"LoRAConfig.targets is empty: name at least one, e.g. {list(DEFAULT_TARGETS)}.")
        if self.base_dtype is not None and self.base_dtype not in BASE_DTYPES:
            raise ValueError(
                f"LoRAConfig.base_dtype must be one of {sorted(BASE_DTYPES)} or None, got {self.base_dtype!r}."
            )

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor of ``B @ A``."""
        return self.alpha / self.rank

    @property
    def torch_base_dtype(self) -> torch.dtype | None:
        """``base_dtype`` as a torch dtype (None: unchanged)."""
        return None if self.base_dtype is None else BASE_DTYPES[self.base_dtype]
