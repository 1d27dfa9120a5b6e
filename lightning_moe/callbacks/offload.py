"""`ActivationOffload`: Megatron Core's fine-grained activation offload from a Trainer.

A thin callback over :func:`lightning_moe.memory.apply_activation_offload`: before the first
forward of ``fit`` (``on_fit_start``) it installs the offload boundaries on every matching
submodule of the LightningModule, starts a new offload micro-batch at every training batch, and
removes the boundaries in ``teardown``::

    Trainer(accelerator="gpu", callbacks=[ActivationOffload(modules=["expert_fc1", "moe_act"])])

Names: ``attn_norm``, ``qkv_linear``, ``core_attn``, ``attn_proj``, ``mlp_norm``,
``expert_fc1``, ``moe_act`` (see :mod:`lightning_moe.memory.offload`). On a CPU-only run the
same code path copies host to host: correct, but it saves no memory, and the callback warns once.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_moe.memory.offload import (
    ActivationOffloader,
    OffloadHandle,
    OffloadStats,
    apply_activation_offload,
    check_offload_modules,
)

__all__ = ["ActivationOffload"]


class ActivationOffload(Callback):
    """Offload the saved activations of ``modules`` to pinned host memory during training.

    Args:
        modules: boundary names from :data:`lightning_moe.memory.OFFLOAD_MODULES`.
        min_tensor_bytes: storages smaller than this stay on the device.
    """

    def __init__(self, modules: Sequence[str] = ("expert_fc1",), min_tensor_bytes: int = 1 << 20) -> None:
        self.modules = check_offload_modules(modules)
        if min_tensor_bytes < 0:
            raise ValueError(f"min_tensor_bytes must be >= 0, got {min_tensor_bytes}.")
        self.min_tensor_bytes = min_tensor_bytes
        self._handle: OffloadHandle | None = None
        self._warned = False

    @property
    def offloader(self) -> ActivationOffloader | None:
        """The offloader in use (None before ``fit``)."""
        return None if self._handle is None else self._handle.offloader

    @property
    def stats(self) -> OffloadStats | None:
        """Bytes and groups moved so far (None before ``fit``)."""
        return None if self._handle is None else self._handle.offloader.stats

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._handle is not None:
            return
        device = pl_module.device
        self._handle = apply_activation_offload(pl_module, self.modules, self.min_tensor_bytes,
                                                ActivationOffloader(device, self.min_tensor_bytes))
        if device.type == "cpu" and not self._warned:
            self._warned = True
            rank_zero_warn(
                "ActivationOffload on a CPU-only run saves no memory: activations are copied host to "
                "host (the logic runs, nothing is freed). Train on a GPU to offload to pinned host memory."
            )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if self._handle is not None:
            self._handle.offloader.start_microbatch()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
