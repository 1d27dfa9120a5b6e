"""The single-device dropless ``grouped_mm`` path never reads the device from the host.

With EP = 1 the local dispatcher hands the experts their row counts as a device tensor and the
``grouped_mm`` kernel builds its group offsets from it, so forward and backward (router with aux
and z losses included) run without a device-to-host copy. On CPU this is checked under
``FakeTensorMode``, where any host read of a tensor's values (``.tolist()``, ``.item()``,
``bool(tensor)``) raises; on CUDA under ``torch.cuda.set_sync_debug_mode("error")``. The staged
forward of the CUDA-graph scopes (``moe_router`` + ``moe_preprocess``, then the eager experts) calls
the experts exactly as the layer does: device counts, the dispatcher's permutation flag, and host
counts for expert modules of the older protocol.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from lightning_moe.graphs.scopes import experts_forward, router_forward
from lightning_moe.layers import expert_kernels
from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.dispatch import LocalDispatcher
from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.layers.moe import MoELayer

HIDDEN, FFN, NUM_EXPERTS = 16, 8, 4
BATCH, SEQ = 2, 8
LOSSES = {"load_balancing": ["aux_loss"], "aux_loss_coeff": 1e-2, "z_loss_coeff": 1e-3}


def _config(**overrides) -> MoEConfig:
    settings = dict(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=NUM_EXPERTS, top_k=2, **LOSSES)
    settings.update(overrides)
    return MoEConfig(**settings)


def _fake_layer(layer: MoELayer, mode: FakeTensorMode) -> MoELayer:
    """``layer`` with every parameter and buffer replaced by a fake tensor of the same metadata."""
    for module in layer.modules():
        for name, param in module._parameters.items():
            if param is not None:
                fake = mode.from_tensor(param.detach())
                module._parameters[name] = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = mode.from_tensor(buffer)
    return layer


def _staged_forward(layer: MoELayer, hidden: torch.Tensor, preprocess: bool = True) -> torch.Tensor:
    """``layer(hidden)`` as the CUDA-graph scopes split it: the router stage, then the eager experts."""
    return experts_forward(layer, router_forward(layer, hidden, None, preprocess=preprocess)).view(hidden.shape)


@pytest.mark.parametrize("forward", ["layer", "staged"])
@pytest.mark.parametrize("fc2_bias", [False, True], ids=["no-bias", "fc2-bias"])
@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_single_device_grouped_mm_path_never_reads_the_device(precision, fc2_bias, forward, monkeypatch):
    # grouped_mm's fake kernel takes bf16 only: the compute policy of CPUs with bf16 units (and GPUs).
    monkeypatch.setattr(expert_kernels, "cpu_has_bf16_units", lambda: True)
    torch.manual_seed(0)
    layer = MoELayer(_config(fc2_bias=fc2_bias), expert_kernel="grouped_mm")
    if precision == "bf16-true":
        layer = layer.to(torch.bfloat16)
    mode = FakeTensorMode()
    layer = _fake_layer(layer.train(), mode)
    with mode:
        with pytest.raises(DataDependentOutputException):
            torch.zeros(2).tolist()  # the detector works: a host read of a fake tensor raises
        dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
        x = torch.randn(BATCH, SEQ, HIDDEN, dtype=dtype, requires_grad=True)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()
        with autocast:
            out = layer(x) if forward == "layer" else _staged_forward(layer, x)
        assert out.shape == x.shape and out.dtype == dtype
        (out * torch.randn_like(out)).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    for name, param in layer.named_parameters():
        assert param.grad is not None and param.grad.shape == param.shape, name


def test_local_dispatcher_counts_are_a_device_tensor_when_dropless():
    """Dropless: ``tokens_per_expert`` stays on the device; drop-and-pad: a static host list; capacity
    dropping and routing-map padding: a host list (their row count needs the device anyway)."""
    tokens = torch.randn(6, HIDDEN)
    routing_map = torch.zeros(6, NUM_EXPERTS, dtype=torch.bool)
    routing_map[torch.arange(6), torch.tensor([0, 1, 1, 2, 3, 3])] = True
    routing_map[torch.arange(6), torch.tensor([1, 2, 3, 0, 0, 1])] = True
    probs = routing_map.float() / 2
    dropless = LocalDispatcher(_config()).dispatch(tokens, probs, routing_map)[1]
    assert isinstance(dropless, torch.Tensor) and dropless.tolist() == [3, 4, 2, 3]
    padded = LocalDispatcher(_config(capacity_factor=1.0, pad_to_capacity=True)).dispatch(tokens, probs, routing_map)[1]
    assert padded == [3] * NUM_EXPERTS
    dropping = LocalDispatcher(_config(capacity_factor=1.0)).dispatch(tokens, probs, routing_map)[1]
    assert dropping == [3, 4, 2, 3]


class _PermutationDispatcher(LocalDispatcher):
    """The local dispatcher, declaring its row index a permutation (true for top-1 dropless routing)."""

    def dispatch(self, hidden, probs, routing_map):
        rows, counts, row_probs, metadata = super().dispatch(hidden, probs, routing_map)
        return rows, counts, row_probs, _PermutationMetadata(metadata.row_index)


@dataclasses.dataclass(frozen=True)
class _PermutationMetadata:
    row_index: torch.Tensor
    row_index_is_permutation: bool = True


class _HostCountExperts(GroupedExperts):
    """An expert module with its own forward of the older protocol (host counts, no permutation flag)."""

    def forward(self, tokens, tokens_per_expert, probs, row_index=None, num_out_rows=None):
        return super().forward(tokens, tokens_per_expert, probs, row_index=row_index, num_out_rows=num_out_rows)


def _record_expert_calls(layer: MoELayer) -> list[tuple[type, bool | None]]:
    """Record (type of ``tokens_per_expert``, ``row_index_is_permutation``) of every call of the experts."""
    calls = []
    forward = layer.experts.forward

    def spy(tokens, tokens_per_expert, probs, **kwargs):
        calls.append((type(tokens_per_expert), kwargs.get("row_index_is_permutation")))
        return forward(tokens, tokens_per_expert, probs, **kwargs)

    layer.experts.forward = spy
    return calls


@pytest.mark.parametrize(
    ("experts", "dispatcher", "preprocess"),
    [
        (GroupedExperts, _PermutationDispatcher, False),
        (_HostCountExperts, _PermutationDispatcher, False),
        (GroupedExperts, LocalDispatcher, True),
        (_HostCountExperts, LocalDispatcher, True),
    ],
    ids=["permutation-flag", "older-protocol", "preprocess-device-counts", "preprocess-older-protocol"],
)
def test_staged_forward_calls_the_experts_like_the_layer(experts, dispatcher, preprocess):
    """``graphs.scopes.experts_forward`` hands the experts what ``MoELayer.forward`` hands them."""
    config = _config(top_k=1, pre_softmax=True)
    torch.manual_seed(0)
    layer = MoELayer(config, expert_kernel="grouped_mm").train()
    layer.experts.__class__ = experts
    layer.dispatcher = dispatcher(config)
    calls = _record_expert_calls(layer)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))
    want = layer(x)
    got = _staged_forward(layer, x, preprocess)
    assert calls[1] == calls[0], f"staged call {calls[1]}, layer call {calls[0]}"
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
def test_single_device_grouped_mm_path_has_no_host_sync_on_cuda():
    """bf16-mixed on CUDA (sm90+: grouped_mm's fast path): after a warm-up step, forward and backward
    of the layer with aux and z losses run under ``set_sync_debug_mode("error")``."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("grouped_mm's fast path needs compute capability sm90 or newer")
    torch.manual_seed(0)
    layer = MoELayer(_config(fc2_bias=True, shared_expert_ffn_hidden_size=FFN), device="cuda").train()
    x = torch.randn(BATCH, SEQ, HIDDEN, device="cuda", requires_grad=True)
    grad_out = torch.randn(BATCH, SEQ, HIDDEN, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert layer.experts.resolved_kernel(x.device, x.dtype) == "grouped_mm"

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x)
        (out.float() * grad_out).sum().backward()

    step()  # warm-up: lazy initialisation (cuBLAS handles, kernels) may synchronise once
    torch.cuda.synchronize()
    layer.zero_grad(set_to_none=True)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()  # gradient accumulation into the existing gradients
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    for name, param in layer.named_parameters():
        assert param.grad is not None and bool(torch.isfinite(param.grad).all()), name
