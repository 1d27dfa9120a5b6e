"""Sharded data parallelism (FSDP2) equals replicated data parallelism, and shards what it predicts.

Oracle: the ``NO_SHARD`` run of the same case (itself checked against one process by
``test_fit_parity.py`` and ``parallel/test_tensor_parallel.py``). On 4 forked gloo ranks, for
(TP, EP, ETP) in (1, 2, 1), (1, 4, 1), (2, 2, 1), with and without gradient accumulation and
clipping, ``SHARD_GRAD_OP`` and ``FULL_SHARD`` must give the same loss at every micro-batch, the
same global gradient norm and the same parameters after 3 AdamW steps (fp32 tolerance), with the
aux loss and the aux-loss-free expert bias on; so must ``defer_gradient_reduction=True`` with
accumulation at TP=2. Under gradient accumulation each micro-batch's backward leaves only
gradient shards (by default) or the unsharded gradients (deferred).

Per-rank bytes of parameters, gradients and AdamW state are measured on the same runs and must
equal the prediction: a rank's ``NO_SHARD`` bytes divided by the dense data-parallel size
``DP * CP`` for dense tensors and by the expert-data-parallel size ``EDP`` for expert tensors, up to
one row of each tensor (FSDP2 splits dimension 0 of dense tensors in ``ceil`` chunks).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import lightning as L
import pytest
import torch
from helpers.asserts import assert_states_close
from helpers.dist import run_distributed
from helpers.fsdp import held_gradients, root_states
from lightning.pytorch.callbacks import Callback
from strategies.toy import quiet_trainer_kwargs
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models import MoETransformerConfig
from lightning_moe.parallel import is_expert_param
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

WORLD = 4
STEPS = 3
SEQ = 8
LOCAL_BATCH = 2
CLIP = 0.05
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-5
LAYOUTS = [(1, 2, 1), (1, 4, 1), (2, 2, 1)]
STRATEGIES = ["SHARD_GRAD_OP", "FULL_SHARD"]


@dataclass(frozen=True)
class Case:
    layout: tuple[int, int, int]
    accumulate: int = 1
    clip: float | None = None
    defer: bool = False  # defer_gradient_reduction (sharded runs only)

    @property
    def name(self) -> str:
        return self.oracle + ("-deferred" if self.defer else "")

    @property
    def oracle(self) -> str:
        """The name of the case whose ``NO_SHARD`` run is the oracle (the same case without deferral)."""
        tp, ep, etp = self.layout
        extra = f"-accum{self.accumulate}-clip" if self.clip else ""
        return f"tp{tp}-ep{ep}-etp{etp}{extra}"


CASES = [c for layout in LAYOUTS for c in (Case(layout), Case(layout, accumulate=2, clip=CLIP))]
CASES.append(Case((2, 2, 1), accumulate=2, clip=CLIP, defer=True))


def model_config(max_seq_len: int = SEQ) -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        first_dense_layers=1, qk_norm=True, max_seq_len=max_seq_len,
        moe=MoEConfig(
            32, 16, 8, top_k=2, shared_expert_ffn_hidden_size=16, score_func="sigmoid", expert_bias=True,
            bias_update_rate=1e-2, load_balancing=["aux_loss"], aux_loss_coeff=1e-2,
        ),
    )


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (WORLD * LOCAL_BATCH * STEPS * 2, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


class Measure(Callback):
    """Losses per micro-batch, the global gradient norm and per-rank bytes at the last step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.bytes: dict[str, dict[str, int]] = {}
        self.held: list[dict[str, int]] = []

    def on_after_backward(self, trainer, pl_module) -> None:
        self.held.append(held_gradients([pl_module]))  # after every micro-batch's backward

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        norm = trainer.strategy.clip_grad_norm_(float("inf"))
        self.norms.append(norm.item())
        sizes = {kind: {"dense": 0, "expert": 0} for kind in ("params", "grads")}
        for p in pl_module.parameters():
            side = "expert" if is_expert_param(p) else "dense"
            sizes["params"][side] += _local_bytes(p)
            if p.grad is not None:
                sizes["grads"][side] += _local_bytes(p.grad)
        self.bytes = sizes

    def on_train_end(self, trainer, pl_module) -> None:
        optimizer = trainer.optimizers[0]
        state = {"dense": 0, "expert": 0}
        for p, entries in optimizer.state.items():
            side = "expert" if is_expert_param(p) else "dense"
            state[side] += sum(_local_bytes(v) for v in entries.values() if torch.is_tensor(v) and v.dim() > 0)
        self.bytes["optimizer"] = state


def _fit(case: Case, sharding: str) -> dict:
    tp, ep, etp = case.layout
    torch.manual_seed(0)
    module = MoELanguageModel(model_config(), learning_rate=1e-2, warmup_steps=0)
    measure = Measure()
    strategy = MoEStrategy(
        tensor_parallel_size=tp, expert_parallel_size=ep, expert_tensor_parallel_size=etp,
        sharding_strategy=sharding, defer_gradient_reduction=case.defer,
    )
    trainer = L.Trainer(
        **quiet_trainer_kwargs(devices=WORLD, strategy=strategy, max_steps=STEPS, callbacks=[measure]),
        accumulate_grad_batches=case.accumulate, gradient_clip_val=case.clip,
        limit_val_batches=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(dataset(), batch_size=LOCAL_BATCH))
    state = module.state_dict()  # collective: the same order on every rank
    params = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}
    # Smallest rows: the rounding allowance of the byte prediction (one dimension-0 row per tensor).
    rows = {"dense": 0, "expert": 0}
    for p in module.parameters():
        side = "expert" if is_expert_param(p) else "dense"
        local = p.to_local() if isinstance(p, DTensor) else p
        rows[side] += (local[0].numel() if local.dim() and local.shape[0] else 0) * local.element_size()
    ctx = strategy.parallel_context
    return {
        "losses": measure.losses, "norms": measure.norms, "params": params, "bytes": measure.bytes, "rows": rows,
        "held": measure.held, "local params": sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                                                  for p in module.parameters()),
        "sizes": {"dp_cp": ctx.size("dp_cp"), "edp": ctx.size("edp")},
        "view warnings": [str(w.message) for w in caught if "returned a view tensor" in str(w.message)],
        "root": isinstance(module, FSDPModule) and [s is module._get_fsdp_state() for s in root_states([module])],
    }


def _all(rank: int, world_size: int) -> dict:
    warnings.filterwarnings("ignore", message=".*redistributing from.*")
    return {(case.name, s): _fit(case, s) for case in CASES for s in (*(() if case.defer else ("NO_SHARD",)), *STRATEGIES)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_all, WORLD, timeout_s=480, tmp_dir=tmp_path_factory.mktemp("sharding"))


@pytest.mark.parametrize("sharding", STRATEGIES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_losses_norms_and_parameters_equal_no_shard(runs, case, sharding):
    for rank, r in enumerate(runs):
        want, got = r[(case.oracle, "NO_SHARD")], r[(case.name, sharding)]
        assert len(got["losses"]) == STEPS * case.accumulate
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                   rtol=LOSS_RTOL, atol=LOSS_ATOL, msg=lambda m, k=rank: f"rank {k} losses: {m}")
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=1e-5, atol=1e-6)
        if case.clip is not None:
            assert min(want["norms"]) > 2 * case.clip  # clipping was active
        assert_states_close(got["params"], want["params"], PARAM_RTOL, PARAM_ATOL, f"rank {rank}")


@pytest.mark.parametrize("sharding", STRATEGIES)
def test_the_lightning_module_is_the_one_fsdp_root(runs, sharding):
    """Its ``training_step`` calls its own forward: one root then drives every unit (streams, prefetch)."""
    for rank, r in enumerate(runs):
        for case in CASES:
            assert r[(case.name, sharding)]["root"] == [True], (rank, case.name, r[(case.name, sharding)]["root"])


@pytest.mark.parametrize("sharding", STRATEGIES)
@pytest.mark.parametrize("case", [c for c in CASES if c.accumulate > 1], ids=lambda c: c.name)
def test_gradient_accumulation_holds_gradient_shards_unless_deferred(runs, case, sharding):
    """After each micro-batch's backward: by default only the gradient shards (the parameter shards'
    elements, none unsharded); deferred, before a step's last micro-batch, no shard yet and the
    ``NO_SHARD`` run's gradient elements unsharded (DP or EDP times the shards)."""
    for rank, r in enumerate(runs):
        got, replicated = r[(case.name, sharding)], r[(case.oracle, "NO_SHARD")]
        assert len(got["held"]) == STEPS * case.accumulate, rank
        for micro, held in enumerate(got["held"]):
            if case.defer and (micro + 1) % case.accumulate:
                # Exactly the NO_SHARD elements: under TP every unsharded gradient is this rank's
                # TP block (the vocabulary-parallel embedding's too: its rows, not the whole vocabulary).
                assert held["sharded"] == 0 and held["unsharded"] == replicated["local params"], (rank, micro, held)
            else:
                assert held == {"sharded": got["local params"], "unsharded": 0}, (rank, micro, held)


def test_no_sharded_unit_returns_a_view(runs):
    """At TP=2 the head's logits came out of DTensor.to_local() as a view: FSDP2 warned on every rank
    (an in-place op on the view would drop its pre-backward hook)."""
    for rank, r in enumerate(runs):
        for key, result in r.items():
            assert not result["view warnings"], (rank, key, result["view warnings"][:1])


def test_training_moved_the_weights_and_the_expert_bias(runs):
    torch.manual_seed(0)
    initial = MoELanguageModel(model_config())
    initial.configure_model()
    start = initial.state_dict()
    got = runs[0][(CASES[0].name, "FULL_SHARD")]["params"]
    assert not torch.equal(got["model.layers.1.ffn.experts.fc1_weight"], start["model.layers.1.ffn.experts.fc1_weight"])
    assert not torch.equal(got["model.layers.1.ffn.router.expert_bias"], start["model.layers.1.ffn.router.expert_bias"])


@pytest.mark.parametrize("sharding", STRATEGIES)
@pytest.mark.parametrize("case", [c for c in CASES if c.accumulate == 1], ids=lambda c: c.name)
def test_per_rank_bytes_equal_the_prediction(runs, case, sharding):
    for r in runs:
        replicated, sharded = r[(case.name, "NO_SHARD")], r[(case.name, sharding)]
        divisors = {"dense": sharded["sizes"]["dp_cp"], "expert": sharded["sizes"]["edp"]}
        for kind in ("params", "grads", "optimizer"):
            per_element = 2 if kind == "optimizer" else 1  # AdamW: exp_avg and exp_avg_sq
            for side, divisor in divisors.items():
                predicted = replicated["bytes"][kind][side] / divisor
                allowance = per_element * sharded["rows"][side]
                measured = sharded["bytes"][kind][side]
                assert abs(measured - predicted) <= allowance, (kind, side, measured, predicted, allowance)
        # The sharding is real: every kind shrank by the data-parallel size on the dense side.
        assert sharded["bytes"]["params"]["dense"] < replicated["bytes"]["params"]["dense"]
