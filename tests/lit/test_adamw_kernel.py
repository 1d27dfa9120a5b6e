"""Which AdamW kernel `MoELanguageModel` asks for: fused on CUDA, torch's default elsewhere.

On CUDA torch's default (the foreach kernels) holds an fp32 temporary of every parameter of a group
during the step; the fused kernel updates in place. The kernel itself, over a tensor-parallel
model's mixed parameter groups, is checked on a GPU by tests/parallel/test_mixed_step_gpu.py.
"""

from __future__ import annotations

import pytest

from lightning_moe.lit.optimization import adamw_kernel_options


@pytest.mark.parametrize(("devices", "options"), [
    ({"cuda"}, {"fused": True}),
    ({"cpu"}, {}),
    ({"cuda", "cpu"}, {}),  # a model split over devices: torch's default handles it
    (set(), {}),
])
def test_fused_only_when_every_parameter_is_on_cuda(devices, options):
    assert adamw_kernel_options(devices) == options
