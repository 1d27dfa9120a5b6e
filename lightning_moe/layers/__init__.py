"""Single-device MoE building blocks: no process groups, no collectives, no lightning.

Pure functions with Megatron Core semantics live in their modules: ``router.topk_routing``,
``router.group_limited_topk``, ``losses.switch_load_balancing_loss``, ``losses.z_loss``,
``permute.permute`` / ``permute.unpermute``.
"""

from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.cpu_gemm import set_cpu_gemm_backend, use_cpu_gemm_backend
from lightning_moe.layers.dispatch import LocalDispatcher, TokenDispatcher
from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.layers.loss_scale import LossGradScale, set_aux_loss_scale
from lightning_moe.layers.moe import MoELayer
from lightning_moe.layers.router import RouterReduction, TopKRouter, update_expert_bias
from lightning_moe.layers.shared_expert import SharedExpertMLP

__all__ = [
    "GroupedExperts",
    "LocalDispatcher",
    "LossGradScale",
    "MoEConfig",
    "MoELayer",
    "RouterReduction",
    "SharedExpertMLP",
    "TokenDispatcher",
    "TopKRouter",
    "set_aux_loss_scale",
    "set_cpu_gemm_backend",
    "update_expert_bias",
    "use_cpu_gemm_backend",
]
