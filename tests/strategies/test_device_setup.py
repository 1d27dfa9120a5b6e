"""The strategy's model preparation runs every collective on the rank's device.

An NCCL process group has no CPU backend: a broadcast of a CPU tensor fails with "No backend type
associated with device type cpu". CPU proxy of that condition: a process group registered for
the ``meta`` device type only (``"meta:fake"``), the meta device standing in for the accelerator.
A collective on any CPU tensor then raises exactly as under NCCL, while collectives on the
"device" (meta) tensors go through. The real thing, one GPU over NCCL, is the ``gpu`` test below
(`benchmarks/gpu_check.sh` runs it).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from strategies.toy import ToyModule, make_dataset, quiet_trainer_kwargs, train_loader
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims, build_parallel_context, is_expert_param
from lightning_moe.parallel.options import ParallelOptions
from lightning_moe.strategies.model_setup import prepare_model

ACCELERATOR = torch.device("meta")
"""Stands in for ``cuda`` in the CPU proxy: the only device type the process group serves."""


@pytest.fixture
def device_only_world():
    """``init(world_size)``: rank 0 of a fake default group that serves ``meta`` tensors only."""

    def init(world_size: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("meta:fake", store=FakeStore(), rank=0, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _transformer() -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2,
        ffn_hidden_size=64, first_dense_layers=1,
        moe=MoEConfig(32, 16, 8, top_k=2, shared_expert_ffn_hidden_size=16),
    ))


def test_the_proxy_group_refuses_cpu_tensors(device_only_world):
    """The condition itself: what the old setup order ran into (broadcast of the CPU-built model)."""
    device_only_world(2)
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.broadcast(torch.zeros(3), src=0)
    dist.broadcast(torch.zeros(3, device=ACCELERATOR), src=0)


@pytest.mark.parametrize(
    ("world", "layout"),
    [(4, {"tp": 2, "ep": 4, "etp": 1}), (2, {"ep": 2}), (1, {})],
    ids=["tp2-ep4-folded", "ep2", "one-process"],
)
def test_prepare_model_moves_a_cpu_model_before_any_collective(device_only_world, world, layout):
    """A model built on the CPU (``__init__`` or ``configure_model``) is sharded on the device."""
    device_only_world(world)
    ctx = build_parallel_context(ParallelDims(world, **layout), ACCELERATOR.type)
    model = _transformer()
    prepare_model(model, ctx, ACCELERATOR, ParallelOptions("alltoall"))
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.device.type == ACCELERATOR.type for t in tensors)
    experts = model.layers[1].ffn.experts
    assert is_expert_param(experts.fc1_weight) and experts.num_experts == 8 // ctx.size("ep")


def test_prepare_model_keeps_meta_tensors_for_materialisation(device_only_world):
    """A partly meta-device model: stored tensors move, meta ones wait for ``materialize``."""
    device_only_world(2)
    ctx = build_parallel_context(ParallelDims(2, ep=2), ACCELERATOR.type)
    model = torch.nn.Sequential(torch.nn.Linear(4, 32))
    with torch.device("meta"):
        model.append(_transformer().layers[1])
    prepare_model(model, ctx, ACCELERATOR, ParallelOptions("allgather"))
    assert model[0].weight.device == ACCELERATOR


@pytest.mark.gpu
def test_one_gpu_fit_over_nccl_with_bf16_mixed(tmp_path):
    """``Trainer.fit`` with `MoEStrategy` on one GPU: the world of one still runs NCCL collectives."""
    import lightning as L

    from lightning_moe.strategies import MoEStrategy

    module = ToyModule(load_balancing=["aux_loss"], aux_loss_coeff=1e-2)  # built on the CPU
    probs_dtypes: list[torch.dtype] = []
    module.net.moe1.router.register_forward_hook(lambda mod, args, out: probs_dtypes.append(out[0].dtype))
    trainer = L.Trainer(**quiet_trainer_kwargs(
        accelerator="gpu", devices=1, max_steps=4, precision="bf16-mixed", default_root_dir=tmp_path,
    ), strategy=MoEStrategy(process_group_backend="nccl"))
    trainer.fit(module, train_loader(make_dataset(16)))
    assert dist.get_backend() == "nccl"
    assert all(p.device.type == "cuda" for p in module.parameters())
    assert len(module.losses) == 4 and all(torch.isfinite(torch.tensor(module.losses)))
    assert probs_dtypes and set(probs_dtypes) == {torch.float32}  # the router stays out of autocast


def test_initialisation_ignores_the_default_device_context():
    """Lightning builds ``configure_model`` modules under the accelerator's device context; weight
    draws use CPU generators and must stay on the CPU there (CPU proxy: a meta default device)."""
    model = _transformer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for tensor in model.parameters():
        tensor.data.zero_()
    with torch.device(ACCELERATOR):
        model.reset_parameters()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=key)


def test_strategy_builds_modules_on_its_device():
    from lightning_moe.strategies import MoEStrategy

    strategy = MoEStrategy(parallel_devices=[torch.device("cpu")])
    with strategy.tensor_init_context():
        assert torch.empty(1).device == torch.device("cpu")
    with strategy.tensor_init_context(empty_init=True):
        assert torch.empty(1).device == ACCELERATOR
