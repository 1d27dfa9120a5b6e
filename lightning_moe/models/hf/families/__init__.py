"""The built-in Hugging Face families, one file each; importing this package registers them.

* :mod:`.mixtral`, :mod:`.qwen2_moe`, :mod:`.qwen3_moe`, :mod:`.olmoe`, :mod:`.deepseek_v3`
  (Kimi K2 too), :mod:`.glm4_moe`: whole models (``from_pretrained`` / ``save_pretrained``) and
  their sparse-MoE blocks (:func:`~lightning_moe.swap_moe_blocks`);
* :mod:`.gpt_oss`: whole models (MXFP4 experts dequantised on load), no block swap.

The registration order is the order :data:`~lightning_moe.models.hf.swap.BLOCK_FAMILIES` lists
the blocks in; :func:`~lightning_moe.models.hf.registry.model_families` sorts the names.
"""

from lightning_moe.models.hf.registry import (
    FAMILIES,
    Family,
    family,
    model_families,
    moe_families,
    register_family,
)

# Registration order is the order errors and BLOCK_FAMILIES list the blocks, so not alphabetical.
# isort: off
from lightning_moe.models.hf.families.mixtral import MIXTRAL
from lightning_moe.models.hf.families.qwen2_moe import QWEN2_MOE
from lightning_moe.models.hf.families.qwen3_moe import QWEN3_MOE
from lightning_moe.models.hf.families.olmoe import OLMOE
from lightning_moe.models.hf.families.deepseek_v3 import DEEPSEEK_V3
from lightning_moe.models.hf.families.glm4_moe import GLM4_MOE
from lightning_moe.models.hf.families.gpt_oss import GPT_OSS
# isort: on

__all__ = [
    "DEEPSEEK_V3", "FAMILIES", "GLM4_MOE", "GPT_OSS", "MIXTRAL", "OLMOE", "QWEN2_MOE", "QWEN3_MOE", "Family", "family",
    "model_families", "moe_families", "register_family",
]
