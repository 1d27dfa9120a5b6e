"""FP8 training of MoE models, two backends, no Lightning (``plugins.MoEFP8Precision`` wraps them).

* :mod:`~lightning_moe.precision.torch_fp8` / :mod:`~lightning_moe.precision.torch_fp8_experts`:
  PyTorch's own scaled FP8 GEMMs (``torch._scaled_mm``, ``torch._scaled_grouped_mm``), row-wise or
  tensor-wise dynamic scaling; needs nothing beyond torch (a CUDA GPU to train).
  :mod:`~lightning_moe.precision.torch_fp8_convert` swaps a model's layers to them.
* :mod:`~lightning_moe.precision.te_fp8`: NVIDIA Transformer Engine recipes (delayed, tensorwise,
  blockwise, MXFP8, NVFP4), imported lazily; ``ImportError`` naming ``pip install
  -e ".[te]"`` when missing. Importing this package never imports Transformer Engine.
* :mod:`~lightning_moe.precision.common`: recipe names, expert token alignment (16/32/128),
  first/last layers in bf16, conversion reports.
"""

from lightning_moe.precision.common import (
    TE_RECIPES,
    TORCH_RECIPES,
    ConversionReport,
    aligned_size,
    apply_token_alignment,
    high_precision_prefixes,
    token_alignment,
)
from lightning_moe.precision.te_fp8 import (
    INSTALL_HINT,
    amax_reduction_group,
    convert_to_te,
    import_te,
    make_te_recipe,
    resolve_backend,
    te_autocast,
    te_available,
)
from lightning_moe.precision.torch_fp8 import (
    Float8Linear,
    TorchFP8Recipe,
    float8_linear,
    quantize,
    require_fp8_device,
    scaled_mm_nt,
)
from lightning_moe.precision.torch_fp8_convert import convert_to_float8
from lightning_moe.precision.torch_fp8_experts import Float8GroupedExperts, float8_grouped_linear

__all__ = [
    "INSTALL_HINT",
    "TE_RECIPES",
    "TORCH_RECIPES",
    "ConversionReport",
    "Float8GroupedExperts",
    "Float8Linear",
    "TorchFP8Recipe",
    "aligned_size",
    "amax_reduction_group",
    "apply_token_alignment",
    "convert_to_float8",
    "convert_to_te",
    "float8_grouped_linear",
    "float8_linear",
    "high_precision_prefixes",
    "import_te",
    "make_te_recipe",
    "quantize",
    "require_fp8_device",
    "resolve_backend",
    "scaled_mm_nt",
    "te_autocast",
    "te_available",
    "token_alignment",
]
