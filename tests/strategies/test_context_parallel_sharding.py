"""Context parallelism combined with sharded data parallelism (FSDP2) equals the replicated run.

Oracle: the ``NO_SHARD`` run of the same layout (itself checked against one process by
``test_context_parallel_fit.py``). On 4 forked gloo ranks, CP=2 x DP=2 (experts sharded over
EDP=4), CP=2 x EP=2 (folded: EDP=2 spans the DP ranks, EP the CP ranks) and CP=2 x TP=2 (FSDP2's
2-D ``(dp_cp, tp)`` shards, TP-partial router and norm gradients), with ``SHARD_GRAD_OP``
and ``FULL_SHARD``: the loss on every rank at every step, the global gradient norm and every
parameter after 3 AdamW steps with clipping equal the ``NO_SHARD`` run (fp32 tolerance), with the
aux loss and the aux-loss-free expert bias on. Dense parameters are sharded over all DP x CP
ranks (one flattened mesh dimension). A CP=2 ``FULL_SHARD`` checkpoint resumes in one process
(CP=1, ``NO_SHARD``) with bitwise equal weights, and ``bf16-mixed`` keeps FSDP2's mixed-precision
policy (bf16 gathered parameters, fp32 reduction into fp32 shards) under CP.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.asserts import assert_states_close
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback
from strategies.test_sharding_parity import model_config
from strategies.toy import quiet_trainer_kwargs
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe.lit import MoELanguageModel
from lightning_moe.parallel import is_expert_param
from lightning_moe.parallel.fully_shard import fully_sharded_modules
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

WORLD = 4
SEQ = 16
STEPS = 3
CLIP = 0.05
LOSS_TOL, PARAM_TOL = 1e-5, 1e-5
LAYOUTS = {
    "cp2-dp2": {},
    "cp2-ep2": {"expert_parallel_size": 2},
    "cp2-tp2": {"tensor_parallel_size": 2, "expert_tensor_parallel_size": 1},
}
STRATEGIES = ["SHARD_GRAD_OP", "FULL_SHARD"]
# The strategies differ only in when FSDP2 frees the gathered parameters: TP needs one of them.
CASES = [(layout, s) for layout in LAYOUTS for s in STRATEGIES if layout != "cp2-tp2" or s == "FULL_SHARD"]


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (WORLD * STEPS, SEQ + 1), generator=g)
    targets = tokens[:, 1:].clone()
    targets[torch.rand(targets.shape, generator=g) < 0.3] = -100  # the CP chunks hold different counts
    return TensorDataset(tokens[:, :-1], targets)


class Record(Callback):
    """This rank's loss per step, the global gradient norm before clipping, the size of the dense
    parameters' data-parallel shard dimension and the dtypes the linear layers compute with."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.dense_shards: set[int] = set()
        self.compute_dtypes: set[torch.dtype] = set()

    def on_train_start(self, trainer, pl_module) -> None:
        # The dtype the sharded units' parameters are gathered in, seen inside each linear's forward.
        for module in pl_module.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda m, args: self.compute_dtypes.add(m.weight.dtype))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.norms.append(trainer.strategy.clip_grad_norm_(float("inf")).item())
        for p in pl_module.parameters():
            if isinstance(p, DTensor) and not is_expert_param(p):
                self.dense_shards.add(p.device_mesh.size(0))  # FSDP2's data-parallel dimension comes first


def _fit(sharding: str, save: Path | None = None, resume: Path | None = None, devices: int = WORLD,
         steps: int = STEPS, precision: str = "32-true", **sizes) -> dict:
    torch.manual_seed(0)
    module = MoELanguageModel(model_config(SEQ), learning_rate=1e-2, warmup_steps=0, min_lr_ratio=1.0)
    record = Record()
    strategy = MoEStrategy(sharding_strategy=sharding, **sizes)
    trainer = L.Trainer(
        **quiet_trainer_kwargs(devices=devices, strategy=strategy, max_steps=steps, callbacks=[record]),
        gradient_clip_val=CLIP, limit_val_batches=0, precision=precision,
    )
    trainer.fit(module, DataLoader(_dataset(), batch_size=1), ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    state = module.state_dict()  # collective: the same order on every rank
    params = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}
    # FSDP2 keeps each unit's policy on its state (private; no public getter in torch 2.13).
    policies = [unit._get_fsdp_state()._mp_policy for unit in fully_sharded_modules(module)]
    return {"losses": record.losses, "norms": record.norms, "params": params, "dense_shards": record.dense_shards,
            "compute_dtypes": record.compute_dtypes,
            "policies": [(p.param_dtype, p.reduce_dtype) for p in policies],
            "param_dtypes": {p.dtype for p in module.parameters()}}


def _four(rank: int, world_size: int, root: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore", message=".*redistributing from.*")
    runs = {}
    for name, sizes in LAYOUTS.items():
        for sharding in ("NO_SHARD", *(s for layout, s in CASES if layout == name)):
            save = Path(root) / "cp2.ckpt" if (name, sharding) == ("cp2-dp2", "FULL_SHARD") else None
            runs[name, sharding] = _fit(sharding, save=save, context_parallel_size=2, **sizes)
    runs["bf16"] = _fit("FULL_SHARD", steps=1, precision="bf16-mixed", context_parallel_size=2)
    return runs


def _one(rank: int, world_size: int, root: str) -> dict:
    # The resumed run stops at once (max_steps reached): what it holds is what it loaded.
    return _fit("NO_SHARD", resume=Path(root) / "cp2.ckpt", devices=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_sharding")
    four = run_distributed(_four, WORLD, str(root), timeout_s=300, tmp_dir=tmp_path_factory.mktemp("pg4"))
    (one,) = run_distributed(_one, 1, str(root), timeout_s=120, tmp_dir=tmp_path_factory.mktemp("pg1"))
    return {"four": four, "resumed": one}


@pytest.mark.parametrize(("layout", "sharding"), CASES)
def test_losses_norms_and_parameters_equal_no_shard(runs, layout, sharding):
    for rank, r in enumerate(runs["four"]):
        want, got = r[layout, "NO_SHARD"], r[layout, sharding]
        assert len(got["losses"]) == STEPS
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                   rtol=LOSS_TOL, atol=LOSS_TOL, msg=lambda m, k=rank: f"rank {k} losses: {m}")
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=1e-5, atol=1e-6)
        assert min(want["norms"]) > 2 * CLIP  # clipping was active
        dp_cp = WORLD // LAYOUTS[layout].get("tensor_parallel_size", 1)
        assert got["dense_shards"] == {dp_cp}  # dense parameters sharded over DP x CP, not DP alone
        assert_states_close(got["params"], want["params"], PARAM_TOL, PARAM_TOL, f"rank {rank}")


def test_training_moved_the_weights_and_the_expert_bias(runs):
    torch.manual_seed(0)
    initial = MoELanguageModel(model_config(SEQ))
    initial.configure_model()
    start = initial.state_dict()
    got = runs["four"][0]["cp2-ep2", "FULL_SHARD"]["params"]
    for name in ("model.layers.1.ffn.experts.fc1_weight", "model.layers.1.ffn.router.expert_bias"):
        assert not torch.equal(got[name], start[name]), name


def test_cp2_full_shard_checkpoint_resumes_at_cp1_no_shard_with_identical_weights(runs):
    resumed, saved = runs["resumed"]["params"], runs["four"][0]["cp2-dp2", "FULL_SHARD"]["params"]
    assert resumed.keys() == saved.keys()
    for name, value in saved.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_bf16_mixed_keeps_the_fsdp_mixed_precision_policy_under_cp(runs):
    for r in runs["four"]:
        bf16 = r["bf16"]
        assert bf16["policies"] and set(bf16["policies"]) == {(torch.bfloat16, torch.float32)}
        assert bf16["compute_dtypes"] == {torch.bfloat16}  # gathered in bf16 for the forward
        assert bf16["param_dtypes"] == {torch.float32}  # fp32 master shards
        assert all(torch.isfinite(torch.tensor(bf16["losses"])))
