"""`ActivationOffload`: Megatron Core's fine-grained activation offload from a Trainer.

A thin callback over :func:`lightning_moe.memory.apply_activation_offload`: before the first
forward of ``fit`` (``on_fit_start``) it installs the offload boundaries on every matching
submodule of the LightningModule, starts a new offload micro-batch at every training batch, and
removes the boundaries in ``teardown``::

    Trainer(accelerator="gpu", callbacks=[ActivationOffload(modules=["expert_fc1", "moe_act"])])

Names: ``attn_norm``, ``qkv_linear``, ``core_attn``, ``attn_proj``, ``mlp_norm``,
``expert_fc1``, ``moe_act`` (see :mod:`lightning_moe.memory.offload`). On a CPU-only run the
same code path copies host to host: correct, but it saves no memory, and the callback warns once.

On your own model (no reference-model names), name the modules of the attention-side names with
``targets``: module types or qualified-name patterns (``*`` within one name component, matched
against the end of the qualified name)::

    ActivationOffload(
        modules=["attn_norm", "qkv_linear", "attn_proj", "expert_fc1"],
        targets={"attn_norm": ["blocks.*.norm1"], "qkv_linear": ["attn.qkv"], "attn_proj": ["attn.proj"]},
    )

A name that matches nothing warns once (rank 0), naming it and what it looks for, and installs
nothing; ``strict=True`` raises ``ValueError`` instead.

Micro-batches: without pipeline parallelism one Lightning batch is one offload micro-batch (one
forward, then its backward). Under ``MoEStrategy(pipeline_parallel_size > 1, num_microbatches=M)``
one batch is ``M`` micro-batches per stage, and the schedule runs several forwards before their
backwards (1F1B's warm-up, GPipe, interleaved virtual stages): the callback then also starts an
offload micro-batch at every forward of each of this rank's stage modules (the strategy's
``pipeline_stages``), so each (micro-batch, stage) keeps the last group of each name on the device
and prefetches within itself, and no backward reloads on demand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import WarningCache

from lightning_moe.memory.handles import ModuleSpec
from lightning_moe.memory.offload import (
    ActivationOffloader,
    OffloadHandle,
    OffloadStats,
    apply_activation_offload,
    check_offload_modules,
    check_offload_targets,
)

__all__ = ["ActivationOffload"]


class ActivationOffload(Callback):
    """Offload the saved activations of ``modules`` to pinned host memory during training.

    Args:
        modules: boundary names from :data:`lightning_moe.memory.OFFLOAD_MODULES`.
        min_tensor_bytes: storages smaller than this stay on the device.
        targets: for ``attn_norm``, ``qkv_linear``, ``core_attn``, ``attn_proj`` and ``mlp_norm``,
            the user's own modules instead of the default rule: a list of ``nn.Module`` types
            and/or qualified-name patterns per name, e.g. ``{"attn_norm": [torch.nn.LayerNorm]}``.
            Each module takes one boundary.
        strict: raise ``ValueError`` instead of warning when a name matches no module.
    """

    def __init__(
        self,
        modules: Sequence[str] = ("expert_fc1",),
        min_tensor_bytes: int = 1 << 20,
        targets: Mapping[str, ModuleSpec | Sequence[ModuleSpec]] | None = None,
        strict: bool = False,
    ) -> None:
        self.modules = check_offload_modules(modules)
        self.targets = check_offload_targets(targets, self.modules)
        if min_tensor_bytes < 0:
            raise ValueError(f"min_tensor_bytes must be >= 0, got {min_tensor_bytes}.")
        self.min_tensor_bytes = min_tensor_bytes
        self.strict = strict
        self._handle: OffloadHandle | None = None
        self._warnings = WarningCache()  # each message once per callback

    @property
    def offloader(self) -> ActivationOffloader | None:
        """The offloader in use (None before ``fit``)."""
        return None if self._handle is None else self._handle.offloader

    @property
    def stats(self) -> OffloadStats | None:
        """Bytes and groups moved so far (None before ``fit``)."""
        return None if self._handle is None else self._handle.offloader.stats

    @property
    def applied(self) -> dict[str, list[str]]:
        """For each name, its boundaries (qualified module names; empty before ``fit``)."""
        return {} if self._handle is None else dict(self._handle.modules)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Install the boundaries on ``pl_module`` (and the micro-batch starts on the pipeline stages, under
        PP); warn (or raise with ``strict``) for unmatched names."""
        if self._handle is not None:
            return
        device = pl_module.device
        handle = apply_activation_offload(pl_module, self.modules, self.min_tensor_bytes,
                                          ActivationOffloader(device, self.min_tensor_bytes), self.targets)
        message = handle.check_unmatched("ActivationOffload", type(pl_module).__name__, self.strict)
        # Under PP (MoEStrategy.pipeline_stages): one offload micro-batch per pipeline micro-batch and stage.
        handle.start_microbatch_at(getattr(trainer.strategy, "pipeline_stages", None) or [])
        self._handle = handle
        if message is not None:
            self._warnings.warn(message)
        if device.type == "cpu":
            self._warnings.warn(
                "ActivationOffload on a CPU-only run saves no memory: activations are copied host to "
                "host (the logic runs, nothing is freed). Train on a GPU to offload to pinned host memory.",
            )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        """Start a new offload micro-batch (under PP each stage forward starts one as well)."""
        if self._handle is not None:
            self._handle.offloader.start_microbatch()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Remove every boundary."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
