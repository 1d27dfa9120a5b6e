"""Sharded data parallelism with meta-device construction, the memory callbacks, bf16-mixed, and its refusals.

Oracle: the ``NO_SHARD`` run of the same module (parity with one process is checked elsewhere).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.asserts import assert_states_close
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from strategies.test_sharding_parity import LOCAL_BATCH, dataset, model_config
from strategies.toy import ToyModule, make_dataset, quiet_trainer_kwargs, train_loader
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_moe.callbacks import (
    ActivationOffload,
    CUDAGraphCapture,
    LoadBalanceMonitor,
    SelectiveRecompute,
)
from lightning_moe.lit import MoELanguageModel
from lightning_moe.parallel import is_expert_param
from lightning_moe.strategies import MoEStrategy
from lightning_moe.strategies.sharding import sharding_mp_policy

pytestmark = pytest.mark.distributed

WORLD = 4
STEPS = 2


class MetaBuilt(MoELanguageModel):
    """Builds its transformer on the meta device, as a model larger than one rank's memory must be."""

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                super().configure_model()


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


class Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.initial: dict[str, torch.Tensor] = {}
        self.storage: dict[str, tuple[int, int]] = {}
        self.compute_dtypes: set[torch.dtype] = set()

    def on_train_start(self, trainer, pl_module) -> None:
        self.initial = {k: _full(v) for k, v in pl_module.state_dict().items()}
        for name, p in pl_module.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            self.storage[name] = (local.numel(), p.numel())
        experts = pl_module.model.layers[1].ffn.experts
        experts.register_forward_pre_hook(lambda module, args: self.compute_dtypes.add(module.fc1_weight.dtype))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def _fit(sharding: str, meta: bool = False, callbacks=(), precision: str = "32-true") -> dict:
    torch.manual_seed(0)
    module = (MetaBuilt if meta else MoELanguageModel)(model_config(), learning_rate=1e-2, warmup_steps=0)
    record = Record()
    strategy = MoEStrategy(
        tensor_parallel_size=2, expert_parallel_size=2, expert_tensor_parallel_size=1, sharding_strategy=sharding,
    )
    trainer = L.Trainer(
        **quiet_trainer_kwargs(devices=WORLD, strategy=strategy, max_steps=STEPS, callbacks=[record, *callbacks]),
        limit_val_batches=0, precision=precision,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=LOCAL_BATCH))
    params = {k: _full(v) for k, v in module.state_dict().items()}
    sharded_dtypes = {p.dtype for p in module.parameters()}
    return {"losses": record.losses, "initial": record.initial, "params": params, "storage": record.storage,
            "compute_dtypes": record.compute_dtypes, "param_dtypes": sharded_dtypes}


def _fit_user_model(sharding: str) -> dict:
    """A user's own module (``strategies.toy``: linear, two MoE layers, linear) with accumulation and clipping."""
    model = ToyModule(load_balancing=["aux_loss"], aux_loss_coeff=1e-2)
    strategy = MoEStrategy(expert_parallel_size=2, sharding_strategy=sharding)
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=WORLD, strategy=strategy, max_steps=STEPS),
                        accumulate_grad_batches=2, gradient_clip_val=0.05)
    trainer.fit(model, train_loader(make_dataset(WORLD * 2 * STEPS * 2)))
    return {"losses": model.losses, "params": {k: _full(v) for k, v in model.state_dict().items()}}


def _memory_callbacks():
    return [SelectiveRecompute(modules=("moe_act", "layernorm", "router")), ActivationOffload(min_tensor_bytes=0),
            LoadBalanceMonitor(log_every_n_steps=1)]


def _all(rank: int, world_size: int) -> dict:
    return {
        "direct": _fit("NO_SHARD"),
        "meta-full": _fit("FULL_SHARD", meta=True),
        "callbacks-replicated": _fit("NO_SHARD", callbacks=_memory_callbacks()),
        "callbacks-full": _fit("FULL_SHARD", callbacks=_memory_callbacks()),
        "callbacks-grad-op": _fit("SHARD_GRAD_OP", callbacks=_memory_callbacks()),
        "bf16-replicated": _fit("NO_SHARD", precision="bf16-mixed"),
        "bf16-full": _fit("FULL_SHARD", precision="bf16-mixed"),
        "user-replicated": _fit_user_model("NO_SHARD"),
        "user-full": _fit_user_model("FULL_SHARD"),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_all, WORLD, timeout_s=420, tmp_dir=tmp_path_factory.mktemp("sharding_options"))


def _assert_same_run(got: dict, want: dict, rtol=1e-5, atol=1e-5, label: str = "") -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=rtol, atol=atol,
                               msg=lambda m: f"{label} losses {got['losses']} vs {want['losses']}: {m}")
    assert_states_close(got["params"], want["params"], rtol, atol)


def test_meta_built_sharded_model_starts_and_trains_like_the_directly_built_one(runs):
    for r in runs:
        meta, direct = r["meta-full"], r["direct"]
        for name, value in direct["initial"].items():  # every weight drawn from its seed: bitwise
            torch.testing.assert_close(meta["initial"][name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
        _assert_same_run(meta, direct)
        # Each rank holds only its shard of every weight: 1/DP of a dense tensor's TP piece, 1/EDP of
        # its local experts (all sizes divide evenly here).
        for name, (local, _) in meta["storage"].items():
            replicated_local, _ = direct["storage"][name]
            assert local * 2 == replicated_local, (name, local, replicated_local)


@pytest.mark.parametrize("run", ["callbacks-full", "callbacks-grad-op"])
def test_recompute_offload_and_load_monitor_combine_with_sharding(runs, run):
    for r in runs:
        _assert_same_run(r[run], r["callbacks-replicated"], label="vs NO_SHARD with callbacks")
        _assert_same_run(r[run], r["direct"], label="vs NO_SHARD without callbacks")  # the callbacks change memory, not the numbers


def test_a_user_model_shards_per_moe_layer_and_trains_like_no_shard(runs):
    for r in runs:
        _assert_same_run(r["user-full"], r["user-replicated"], label="user model FULL_SHARD vs NO_SHARD")


def test_bf16_mixed_gathers_bf16_and_keeps_fp32_master_weights(runs):
    policy = sharding_mp_policy("bf16-mixed")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert sharding_mp_policy("32-true") is None and sharding_mp_policy("bf16-true") is None
    for r in runs:
        full, replicated = r["bf16-full"], r["bf16-replicated"]
        assert full["compute_dtypes"] == {torch.bfloat16}, "FSDP2 gathers the experts in bf16"
        assert replicated["compute_dtypes"] == {torch.float32}, "NO_SHARD keeps fp32 weights under autocast"
        assert full["param_dtypes"] == {torch.float32}, "the sharded (master) parameters stay fp32"
        # Both compute the matmuls in bf16 (autocast or bf16 weights); the roundings differ slightly.
        torch.testing.assert_close(torch.tensor(full["losses"]), torch.tensor(replicated["losses"]), rtol=2e-2, atol=2e-2)


def _refused(rank: int, world_size: int, kind: str) -> str:
    kwargs, callbacks = {}, []
    if kind == "16-mixed":  # Lightning turns precision="16-mixed" into bf16 on the CPU: the plugin itself
        kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    elif kind == "cuda-graphs":
        callbacks.append(CUDAGraphCapture())
    strategy = MoEStrategy(expert_parallel_size=2, sharding_strategy="FULL_SHARD")
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=world_size, strategy=strategy, max_steps=1, callbacks=callbacks),
                        **kwargs)
    try:
        trainer.fit(MoELanguageModel(model_config()), DataLoader(dataset(), batch_size=LOCAL_BATCH))
    except ValueError as err:
        return str(err)
    return "not refused"


@pytest.mark.parametrize(("kind", "match"), [("16-mixed", "precision='16-mixed'"), ("cuda-graphs", "CUDAGraphCapture")])
def test_combinations_not_supported_yet_are_refused_naming_both_options(kind, match, tmp_path):
    messages = run_distributed(_refused, 2, kind, tmp_dir=tmp_path)
    for message in messages:
        assert match in message and "sharding_strategy='NO_SHARD'" in message, message


def test_unknown_sharding_strategy_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"Unknown sharding_strategy 'HYBRID'.*'NO_SHARD', 'SHARD_GRAD_OP', 'FULL_SHARD'"):
        MoEStrategy(sharding_strategy="HYBRID")


def test_a_model_with_parameters_of_its_own_is_refused_before_anything_changes():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_moe import MoEConfig, MoELayer
    from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize

    model = torch.nn.Module()
    model.scale = torch.nn.Parameter(torch.ones(1))
    model.moe = MoELayer(MoEConfig(8, 16, 4, top_k=2))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        ctx = build_parallel_context(ParallelDims(2, ep=2), "cpu")
        with pytest.raises(ValueError, match=r"Module holds parameters of its own \(scale\)"):
            parallelize(model, ctx, sharding_strategy="FULL_SHARD")
    finally:
        dist.destroy_process_group()
    assert not any(is_expert_param(p) for p in model.parameters()), "refused before anything changed"


def test_expert_data_parallel_size_must_divide_the_hidden_size():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_moe import MoEConfig
    from lightning_moe.models import MoETransformer, MoETransformerConfig
    from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize

    config = MoETransformerConfig(vocab_size=64, hidden_size=36, num_layers=1, num_attention_heads=2,
                                  moe=MoEConfig(36, 16, 4, top_k=2))
    with torch.device("meta"):
        model = MoETransformer(config)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        ctx = build_parallel_context(ParallelDims(8, ep=1), "cpu")
        with pytest.raises(ValueError, match="EDP=8 splits their hidden size 36"):
            parallelize(model, ctx, sharding_strategy="FULL_SHARD")
    finally:
        dist.destroy_process_group()  # forked ranks of later tests must not inherit it
    assert not any(is_expert_param(p) for p in model.parameters()), "refused before anything changed"
