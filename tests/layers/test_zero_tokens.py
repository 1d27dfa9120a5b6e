"""`MoELayer` with zero tokens: an expert-parallel rank or a micro-batch can have none.

The oracle is trivial and independent of the library: an empty output of the input's shape, a
zero input gradient, zero (finite) parameter gradients, nothing counted and every configured
loss logged as 0. Every path is covered: both expert kernels, ``[0, H]``, ``[B, 0, H]`` and
``[0, S, H]`` inputs, with and without a padding mask, each load-balancing type and the z-loss,
capacity with and without ``pad_to_capacity``, routing-map padding, the shared expert and the
expert bias.

A zero-token micro-batch records its losses as 0 rather than not at all: its share of the
group's loss is exactly 0 (the ranks' shares sum to the loss), every rank must record the same
number of micro-batches for ``ExpertLoadMetric`` (it sums the ranks' sums and divides by the
common count) and an all-padding micro-batch already records 0 the same way.
"""

from __future__ import annotations

import pytest
import torch
from layers.test_experts_mixed import _OpRecorder

from lightning_moe.layers import expert_kernels
from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.moe import MoELayer
from lightning_moe.layers.router import LOGGED_LOSS_NAMES

# Multiples of 8: torch's CPU grouped_mm needs rows of 16 bytes (see test_moe_layer.py).
HIDDEN, FFN, NUM_EXPERTS, SHARED_FFN = 16, 8, 4, 8
KERNELS = ("loop", "grouped_mm")
EMPTY_SHAPES = {"[0, H]": (0,), "[B, 0, H]": (2, 0), "[0, S, H]": (0, 3)}
AUX = {"aux_loss_coeff": 1e-2, "z_loss_coeff": 1e-3}
ALL_LOSSES = {"load_balancing": ["aux_loss", "seq_aux_loss", "global_aux_loss"], **AUX}
VARIANTS = {
    "no losses": {},
    "aux_loss": {"load_balancing": ["aux_loss"], "aux_loss_coeff": 1e-2},
    "seq_aux_loss": {"load_balancing": ["seq_aux_loss"], "aux_loss_coeff": 1e-2},
    "global_aux_loss": {"load_balancing": ["global_aux_loss"], "aux_loss_coeff": 1e-2},
    "z_loss": {"z_loss_coeff": 1e-3},
    "all losses": ALL_LOSSES,
    "capacity": {"capacity_factor": 1.0, **ALL_LOSSES},
    "capacity, pad_to_capacity": {"capacity_factor": 1.0, "pad_to_capacity": True, **ALL_LOSSES},
    "router padding alignment": {"router_padding_alignment": 4, **ALL_LOSSES},
    "shared expert": {"shared_expert_ffn_hidden_size": SHARED_FFN, "shared_expert_gate": True, **ALL_LOSSES},
    "expert bias, fc2 bias": {"score_func": "sigmoid", "expert_bias": True, "fc2_bias": True, **ALL_LOSSES},
}
_LOGGED_NAME = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def _config(**overrides) -> MoEConfig:
    settings = {"hidden_size": HIDDEN, "ffn_hidden_size": FFN, "num_experts": NUM_EXPERTS, "top_k": 2}
    settings.update(overrides)
    return MoEConfig(**settings)


def _layer(config: MoEConfig, kernel: str) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(config, expert_kernel=kernel).train()
    layer.router.aux_loss_scale = 1.0
    return layer


def _expected_logged(config: MoEConfig) -> set[str]:
    names = {_LOGGED_NAME[kind] for kind, coeff in config.aux_loss_coeffs.items() if coeff > 0}
    return names | ({"z_loss"} if config.z_loss_coeff is not None else set())


def _assert_zero(tensor: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(tensor, torch.zeros_like(tensor), rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding-mask"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", list(EMPTY_SHAPES))
@pytest.mark.parametrize("kernel", KERNELS)
def test_zero_tokens_give_an_empty_output_zero_losses_and_zero_gradients(kernel, shape, variant, masked):
    config = _config(**VARIANTS[variant])
    layer = _layer(config, kernel)
    x = torch.randn(*EMPTY_SHAPES[shape], HIDDEN, requires_grad=True)
    mask = torch.zeros(x.shape[:-1], dtype=torch.bool) if masked else None

    out = layer(x, mask)
    _assert_zero(out, "output")  # shape, dtype and (no) values of the empty oracle
    out.sum().backward()

    _assert_zero(x.grad, "input gradient")
    for name, param in layer.named_parameters():
        assert param.grad is not None, f"{name} got no gradient (DDP would see an unused parameter)"
        _assert_zero(param.grad, f"gradient of {name}")
    logged = layer.router.logged_losses()
    assert set(logged) == _expected_logged(config)
    for name, value in logged.items():
        _assert_zero(value, f"logged {name}")
    router = layer.router
    _assert_zero(router.local_tokens_per_expert, "expert-bias counts")
    _assert_zero(router.global_tokens_per_expert, "global aux-loss counts")
    for name, value in router.read_metric_stats().items():
        _assert_zero(value, f"metric {name}")
    # A micro-batch was seen: the global aux loss's running mean counts it.
    assert router.global_aux_loss_steps.item() == ("global_aux_loss" in config.load_balancing)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_zero_token_micro_batch_is_logged_as_zero(kernel):
    """Recorded, as 0: the mean over two micro-batches, one of them empty, is half the other's value."""
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(3))
    once = _layer(_config(**ALL_LOSSES), kernel)
    once(x).sum().backward()
    expected = once.router.logged_losses()

    layer = _layer(_config(**ALL_LOSSES), kernel)
    layer(x).sum().backward()
    layer(torch.randn(0, HIDDEN)).sum().backward()
    logged = layer.router.logged_losses()
    assert set(logged) == set(expected) == set(LOGGED_LOSS_NAMES)
    for name in LOGGED_LOSS_NAMES:
        assert torch.isfinite(expected[name]) and expected[name] > 0, name
        torch.testing.assert_close(logged[name], expected[name] / 2, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_zero_tokens_in_evaluation(kernel):
    layer = _layer(_config(**ALL_LOSSES), kernel).eval()
    with torch.no_grad():
        out = layer(torch.randn(0, 4, HIDDEN))
    _assert_zero(out, "output")
    assert not layer.router.logged_losses()


@pytest.mark.parametrize("kernel", KERNELS)
def test_zero_tokens_under_cpu_bf16_autocast(kernel, monkeypatch):
    """CPU proxy of bf16-mixed training on a GPU: the empty output keeps the input dtype."""
    # The bf16 compute policy of CPUs with bf16 units (and of GPUs), so grouped_mm runs in bf16.
    monkeypatch.setattr(expert_kernels, "cpu_has_bf16_units", lambda: True)
    layer = _layer(_config(shared_expert_ffn_hidden_size=SHARED_FFN, **ALL_LOSSES), kernel)
    x = torch.randn(2, 0, HIDDEN, requires_grad=True)
    recorder = _OpRecorder()
    with recorder:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
        assert out.dtype == torch.float32 and out.shape == x.shape
        out.sum().backward()
    if kernel == "grouped_mm":  # the zero rows really went through the bf16 grouped GEMMs
        seen = recorder.operand_dtypes(torch.ops.aten._grouped_mm.default)
        assert seen and all(d == (torch.bfloat16, torch.bfloat16) for d in seen), seen
    for name, param in layer.named_parameters():
        assert param.grad is not None and param.grad.dtype == param.dtype, name
        _assert_zero(param.grad, f"gradient of {name}")
    for name, value in layer.router.logged_losses().items():
        _assert_zero(value, f"logged {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(EMPTY_SHAPES))
@pytest.mark.parametrize("kernel", ["auto", "loop"])
def test_zero_tokens_on_cuda_under_bf16_autocast(kernel, shape):
    """bf16-mixed on a GPU (``auto`` is grouped_mm on sm90): zero rows through the CUDA kernels."""
    device = torch.device("cuda")
    config = _config(shared_expert_ffn_hidden_size=SHARED_FFN, **ALL_LOSSES)
    layer = _layer(config, kernel).to(device)
    x = torch.randn(*EMPTY_SHAPES[shape], HIDDEN, device=device, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x, torch.zeros(x.shape[:-1], dtype=torch.bool, device=device))
    assert out.dtype == torch.float32 and out.shape == x.shape
    out.sum().backward()
    for name, param in layer.named_parameters():
        assert param.grad is not None, name
        _assert_zero(param.grad, f"gradient of {name}")
    logged = layer.router.logged_losses()
    assert set(logged) == set(LOGGED_LOSS_NAMES)
    for name, value in logged.items():
        _assert_zero(value, f"logged {name}")
    for name, value in layer.router.read_metric_stats().items():
        _assert_zero(value, f"metric {name}")
