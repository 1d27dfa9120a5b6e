"""Expert-bias updates and the global aux-loss reset at the end of each global batch.

Unit tests of :mod:`lightning_moe.parallel.expert_bias` (sign rule, several routers, zeroed counts,
one all-reduce on forked ranks), and Trainer runs with :class:`ExpertBiasUpdater`: biases after
``STEPS`` optimizer steps equal a single-device recomputation of the sign rule (same model, same
global batches, counts accumulated per micro-batch), at EP=2, with and
without gradient accumulation, and with reentrant ``moe`` recompute. `MoEStrategy` adds the
callback by itself (once), and the global aux loss's running statistics are reset per global batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed
from lightning.pytorch.callbacks import Callback
from strategies.toy import quiet_trainer_kwargs, sample_indices
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe import MoEConfig, MoELayer, TopKRouter
from lightning_moe.callbacks import ExpertBiasUpdater
from lightning_moe.callbacks.expert_bias import count_reduction_group
from lightning_moe.parallel.expert_bias import (
    needs_global_batch_updates,
    reset_global_aux_loss_states,
    routers_of,
    update_expert_biases,
)
from lightning_moe.strategies import MoEStrategy

IN_FEATURES, HIDDEN, FFN, SEQ = 6, 16, 8, 4
LAYER_SHAPES = {"moe1": (8, 2, 1e-3), "moe2": (4, 2, 2e-3)}
"""Per MoE layer: (experts, top-k, bias update rate); different sizes and rates on purpose."""
LOCAL_BATCH = 4
"""Samples per data-parallel rank and micro-batch."""
STEPS = 3
LR = 0.5
"""SGD step: large enough that the router weights move and routing changes between steps too."""
MODEL_SEED, DATA_SEED = 7, 5
WORLD = 2
NUM_SAMPLES = 2 * LOCAL_BATCH * 2 * STEPS  # DP=2, accumulation 2, STEPS steps


# -- unit tests of the core functions ---------------------------------------------------------------


def _router(num_experts: int = 4, rate: float = 1e-3, **overrides) -> TopKRouter:
    kwargs = dict(
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_experts=num_experts,
        top_k=2,
        score_func="sigmoid",
        expert_bias=True,
        bias_update_rate=rate,
    )
    kwargs.update(overrides)
    return TopKRouter(MoEConfig(**kwargs))


def _sign_rule(bias: Tensor, counts: Tensor, rate: float) -> Tensor:
    """Reference ``bias + rate * sign(mean(c) - c)`` with the mean in fp64, the bias in fp32."""
    c = counts.double()
    return bias + rate * torch.sign(c.mean() - c).float()


def test_sign_rule_reference_example():
    """docs/numerics.md §7: counts [10, 2, 4, 0], rate 1e-3 -> [-1e-3, +1e-3, 0, +1e-3]; counts zeroed."""
    router = _router()
    router.local_tokens_per_expert.copy_(torch.tensor([10, 2, 4, 0]))
    summed = update_expert_biases([router])
    assert router.expert_bias.dtype == torch.float32
    torch.testing.assert_close(router.expert_bias, torch.tensor([-1e-3, 1e-3, 0.0, 1e-3]), rtol=0, atol=0)
    assert router.local_tokens_per_expert.tolist() == [0, 0, 0, 0]
    assert [c.tolist() for c in summed] == [[10, 2, 4, 0]]
    # A second update without new counts changes nothing (sign(0) = 0).
    update_expert_biases([router])
    torch.testing.assert_close(router.expert_bias, torch.tensor([-1e-3, 1e-3, 0.0, 1e-3]), rtol=0, atol=0)


def test_several_routers_of_a_model():
    """Every router with a bias is updated with its own rate; eval routers keep theirs; all counts zeroed."""
    model = nn.ModuleDict(
        {
            "a": _router(4, 1e-3),
            "b": _router(8, 2e-3),
            "plain": _router(4, expert_bias=False, score_func="softmax"),
            "frozen": _router(4, 1e-3),
        }
    )
    model["b"].expert_bias.copy_(torch.linspace(-0.01, 0.01, 8))
    counts = {
        "a": torch.tensor([3, 3, 1, 5]),
        "b": torch.tensor([0, 9, 4, 4, 4, 1, 7, 3]),
        "plain": torch.tensor([1, 2, 3, 4]),
        "frozen": torch.tensor([9, 0, 0, 0]),
    }
    for name, c in counts.items():
        model[name].local_tokens_per_expert.copy_(c)
    model["frozen"].eval()
    before = {name: model[name].expert_bias.clone() for name in ("a", "b", "frozen")}

    summed = update_expert_biases(model)

    assert [c.tolist() for c in summed] == [counts[n].tolist() for n in ("a", "b", "frozen")]
    for name, rate in (("a", 1e-3), ("b", 2e-3)):
        torch.testing.assert_close(
            model[name].expert_bias, _sign_rule(before[name], counts[name], rate), rtol=0, atol=0
        )
    torch.testing.assert_close(model["frozen"].expert_bias, before["frozen"], rtol=0, atol=0)
    assert model["plain"].expert_bias is None
    for name in counts:
        assert model[name].local_tokens_per_expert.abs().sum().item() == 0, name


def test_model_without_expert_bias_zeroes_counts_without_communication():
    router = _router(expert_bias=False, score_func="softmax")
    router.local_tokens_per_expert.fill_(3)
    # No router has a bias, so not even a (non-initialised) process group is touched.
    assert update_expert_biases(nn.Sequential(router), group=object()) == []
    assert router.local_tokens_per_expert.tolist() == [0, 0, 0, 0]


def test_routers_of_rejects_other_objects():
    with pytest.raises(TypeError, match=r"expected an nn.Module .* or an iterable of TopKRouter, got int"):
        routers_of(42)
    with pytest.raises(TypeError, match="iterable of TopKRouter, got list"):
        update_expert_biases([nn.Linear(2, 2)])
    shared = _router()
    assert routers_of(nn.ModuleList([shared, nn.Sequential(shared)])) == [shared]


def test_needs_global_batch_updates():
    assert needs_global_batch_updates(nn.Sequential(_router()))
    assert needs_global_batch_updates(
        [_router(expert_bias=False, load_balancing=["global_aux_loss"], aux_loss_coeff=1e-2)]
    )
    assert not needs_global_batch_updates(
        [_router(expert_bias=False, load_balancing=["aux_loss"], aux_loss_coeff=1e-2)]
    )
    assert not needs_global_batch_updates(nn.Linear(2, 2))


def _layer(**overrides) -> MoELayer:
    kwargs = dict(
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_experts=8,
        top_k=2,
        score_func="sigmoid",
        expert_bias=True,
        init_std=0.2,
    )
    kwargs.update(overrides)
    return MoELayer(MoEConfig(**kwargs))


def test_reentrant_recompute_counts_each_micro_batch_once():
    """Reentrant checkpointing runs the forward under no_grad (no count) and recounts in backward, once."""
    layer = _layer()
    x = torch.randn(3, SEQ, HIDDEN, requires_grad=True)
    layer(x).sum().backward()
    plain = layer.router.local_tokens_per_expert.clone()
    assert plain.sum().item() == 3 * SEQ * 2
    layer.router.local_tokens_per_expert.zero_()

    out = checkpoint(layer, x, use_reentrant=True)
    assert layer.router.local_tokens_per_expert.sum().item() == 0  # the no_grad forward did not count
    out.sum().backward()
    assert layer.router.local_tokens_per_expert.tolist() == plain.tolist()
    with torch.no_grad():
        layer(x)
    layer.eval()
    layer(x)
    assert layer.router.local_tokens_per_expert.tolist() == plain.tolist()


def test_reset_global_aux_loss_states():
    layer = _layer(expert_bias=False, load_balancing=["global_aux_loss"], aux_loss_coeff=1e-2)
    x = torch.randn(2, SEQ, HIDDEN)
    for _ in range(2):
        layer(x).sum().backward()
    router = layer.router
    assert router.global_aux_loss_steps.item() == 2
    assert router.global_tokens_per_expert.sum().item() == 2 * 2 * SEQ * 2
    reset_global_aux_loss_states(nn.Sequential(layer))
    assert router.global_aux_loss_steps.item() == 0
    assert router.global_tokens_per_expert.sum().item() == 0


def test_count_reduction_group_in_one_process():
    class NotBuilt:
        @property
        def parallel_context(self):
            raise RuntimeError("not built yet")

    assert count_reduction_group(object()) is None
    assert count_reduction_group(NotBuilt()) is None
    assert count_reduction_group(SimpleNamespace(parallel_context=None)) is None


RANK_COUNTS = {
    "a": [torch.tensor([5, 0, 2, 1]), torch.tensor([1, 6, 2, 3])],
    "b": [torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]), torch.tensor([7, 6, 5, 4, 0, 2, 1, 0])],
}


def _one_all_reduce(rank: int, world_size: int) -> dict:
    model = nn.ModuleDict({"a": _router(4, 1e-3), "b": _router(8, 2e-3), "plain": _router(expert_bias=False)})
    results = {}
    calls: list = []
    original = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append((tensor.dtype, tuple(tensor.shape)))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        for group_kind in ("world", "none"):
            calls.clear()
            for name, per_rank in RANK_COUNTS.items():
                model[name].local_tokens_per_expert.copy_(per_rank[rank])
                model[name].expert_bias.zero_()
            model["plain"].local_tokens_per_expert.fill_(rank + 1)
            update_expert_biases(model, group=dist.group.WORLD if group_kind == "world" else None)
            results[group_kind] = {
                "calls": list(calls),
                "biases": {name: model[name].expert_bias.clone() for name in RANK_COUNTS},
                "counts_left": sum(r.local_tokens_per_expert.abs().sum().item() for r in routers_of(model)),
            }
    finally:
        dist.all_reduce = original
    return results


@pytest.mark.distributed
def test_one_all_reduce_sums_counts_over_the_group(tmp_path):
    ranks = run_distributed(_one_all_reduce, WORLD, tmp_dir=tmp_path)
    rates = {"a": 1e-3, "b": 2e-3}
    for rank, result in enumerate(ranks):
        world, local = result["world"], result["none"]
        assert world["calls"] == [(torch.int64, (4 + 8,))], "one int64 all-reduce for all routers"
        assert local["calls"] == []
        for name, per_rank in RANK_COUNTS.items():
            summed = per_rank[0] + per_rank[1]
            want = _sign_rule(torch.zeros(len(summed)), summed, rates[name])
            torch.testing.assert_close(world["biases"][name], want, rtol=0, atol=0)
            want_local = _sign_rule(torch.zeros(len(summed)), per_rank[rank], rates[name])
            torch.testing.assert_close(local["biases"][name], want_local, rtol=0, atol=0)
        assert world["counts_left"] == local["counts_left"] == 0
    # The summed counts make a different update than either rank's own (the reduction matters).
    assert not torch.equal(ranks[0]["world"]["biases"]["a"], ranks[0]["none"]["biases"]["a"])


# -- Trainer runs ---------------------------------------------------------------------------------


def _layer_config(name: str, **overrides) -> MoEConfig:
    num_experts, top_k, rate = LAYER_SHAPES[name]
    kwargs = dict(
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_experts=num_experts,
        top_k=top_k,
        score_func="sigmoid",
        expert_bias=True,
        bias_update_rate=rate,
        init_std=0.2,
    )
    kwargs.update(overrides)
    return MoEConfig(**kwargs)


class BiasNet(nn.Module):
    """Linear in, two residual MoE layers (sigmoid routing with expert bias), linear head; one device.

    With ``recompute`` each MoE layer call is wrapped in reentrant activation checkpointing (the
    ``moe`` recompute scope): its forward runs under ``no_grad`` and again in backward.
    """

    def __init__(self, recompute: bool = False, **overrides) -> None:
        super().__init__()
        torch.manual_seed(MODEL_SEED)
        self.recompute = recompute
        self.inp = nn.Linear(IN_FEATURES, HIDDEN)
        self.moe1 = MoELayer(_layer_config("moe1", **overrides))
        self.moe2 = MoELayer(_layer_config("moe2", **overrides))
        self.head = nn.Linear(HIDDEN, 1)

    def _moe(self, layer: MoELayer, h: Tensor) -> Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(layer, h, use_reentrant=True)
        return layer(h)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        h = h + self._moe(self.moe1, h)
        h = h + self._moe(self.moe2, h)
        return self.head(h)


class BiasModule(L.LightningModule):
    """The one-device module; under TP it feeds each TP rank its slice of the sequence (as sequence
    parallelism does) and divides its loss by TP, so the summed gradients are the full batch's."""

    def __init__(self, recompute: bool = False, **overrides) -> None:
        super().__init__()
        self.net = BiasNet(recompute, **overrides)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        tp, tp_rank = 1, 0
        ctx = getattr(self.trainer.strategy, "parallel_context", None)
        if ctx is not None:
            tp, tp_rank = ctx.size("tp"), ctx.rank_in("tp")
        x, y = x.chunk(tp, dim=1)[tp_rank], y.chunk(tp, dim=1)[tp_rank]
        return nn.functional.mse_loss(self.net(x), y) / tp

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def make_dataset(num_samples: int = NUM_SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(num_samples, SEQ, IN_FEATURES, generator=g)
    return TensorDataset(x, torch.randn(num_samples, SEQ, 1, generator=g), torch.arange(num_samples))


def _routers(net: nn.Module) -> dict[str, TopKRouter]:
    return {name: m.router for name, m in net.named_modules() if isinstance(m, MoELayer)}


class Probe(Callback):
    """Records, per rank: the local counts at each optimizer step (it runs before the updater, which
    is later in the callback list), and after each batch the global step, biases and aux-loss steps."""

    def __init__(self) -> None:
        self.counts: list[dict[str, list[int]]] = []
        self.after_batch: list[tuple[int, dict[str, Tensor], int]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.counts.append(
            {n: r.local_tokens_per_expert.tolist() for n, r in _routers(pl_module.net).items()}
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        routers = _routers(pl_module.net)
        biases = {n: r.expert_bias.clone() for n, r in routers.items() if r.expert_bias is not None}
        self.after_batch.append((trainer.global_step, biases, routers["moe1"].global_aux_loss_steps.item()))

    def biases_per_step(self) -> list[dict[str, Tensor]]:
        """Biases after each optimizer step (the last batch of each global batch)."""
        last: dict[int, dict[str, Tensor]] = {}
        for step, biases, _ in self.after_batch:
            last[step] = biases
        return [last[s] for s in sorted(last) if s > 0]


@dataclass
class Reference:
    counts: list[dict[str, list[int]]] = field(default_factory=list)
    """Counts of each router over each global batch (all micro-batches and data-parallel shards)."""
    biases: list[dict[str, Tensor]] = field(default_factory=list)
    """Biases after each optimizer step."""


@functools.cache  # a pure function of its arguments (seeded model, fixed data); the tests only read it
def reference_run(accumulate: int, dp: int | None, steps: int = STEPS) -> Reference:
    """The single-device oracle: plain PyTorch, the sign rule written out.

    Each optimizer step runs ``accumulate`` global micro-batches; each is the ``dp`` shards that
    Lightning's DistributedSampler deals (``dp=None``: one process, the loader's order), each shard
    run through the model on its own. Counts come from the routing maps the routers return (a
    forward hook), not from their count buffers; gradients are the mean over shards and
    micro-batches (the data-parallel objective), stepped with SGD like the Trainer runs.
    """
    net = BiasNet()
    routers = _routers(net)
    counts = {n: torch.zeros(r.config.num_experts, dtype=torch.int64) for n, r in routers.items()}

    def count(name: str, output: tuple[Tensor, Tensor]) -> None:
        counts[name] += output[1].sum(0)

    for name, router in routers.items():
        router.register_forward_hook(lambda m, args, out, n=name: count(n, out))
    params = dict(net.named_parameters())
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    dataset = make_dataset()
    x, y, _ = dataset.tensors
    result = Reference()
    for step in range(steps):
        total = {n: torch.zeros_like(p) for n, p in params.items()}
        for micro in range(accumulate):
            i = step * accumulate + micro
            if dp is None:
                shards = [list(range(i * LOCAL_BATCH, (i + 1) * LOCAL_BATCH))]
            else:
                shards = [
                    sample_indices(r, i, len(dataset), dp=dp, local_batch=LOCAL_BATCH) for r in range(dp)
                ]
            for shard in shards:
                net.zero_grad(set_to_none=True)
                nn.functional.mse_loss(net(x[shard]), y[shard]).backward()
                for n, p in params.items():
                    total[n] += p.grad / (accumulate * len(shards))
        result.counts.append({n: c.tolist() for n, c in counts.items()})
        with torch.no_grad():
            for name, router in routers.items():
                router.expert_bias.copy_(
                    _sign_rule(router.expert_bias, counts[name], router.config.bias_update_rate)
                )
                counts[name].zero_()
        result.biases.append({n: r.expert_bias.clone() for n, r in routers.items()})
        for n, p in params.items():
            p.grad = total[n]
        optimizer.step()
    return result


def _assert_matches_reference(
    biases: list[dict[str, Tensor]],
    counts: list[dict[str, list[int]]],
    ref: Reference,
    accumulate: int,
    tokens_per_micro_batch: int,
) -> None:
    assert len(biases) == len(ref.biases) == STEPS
    assert counts == ref.counts
    for step, (got, want) in enumerate(zip(biases, ref.biases)):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(
                got[name], want[name], rtol=0, atol=0, msg=lambda m, n=name, s=step: f"step {s} {n}: {m}"
            )
    for step_counts in ref.counts:  # one count per token, top-k and micro-batch (none doubled by recompute)
        for name, c in step_counts.items():
            assert sum(c) == accumulate * tokens_per_micro_batch * LAYER_SHAPES[name][1]
    # Not vacuous: the biases moved, differently per expert, and changed the routing over the steps.
    last = ref.biases[-1]
    assert all(b.abs().max() > 0 and len(set(b.tolist())) > 1 for b in last.values())
    assert len({tuple(c["moe1"]) for c in ref.counts}) > 1


def test_single_process_trainer_with_accumulation_and_recompute():
    """One process, no strategy reduction: the callback (passed by the user) equals the oracle."""
    module, probe = BiasModule(recompute=True), Probe()
    trainer = L.Trainer(
        **quiet_trainer_kwargs(devices=1, max_steps=STEPS, callbacks=[probe, ExpertBiasUpdater()]),
        accumulate_grad_batches=2,
    )
    trainer.fit(module, DataLoader(make_dataset(), batch_size=LOCAL_BATCH, shuffle=False))
    assert trainer.global_step == STEPS
    ref = reference_run(accumulate=2, dp=None)
    _assert_matches_reference(probe.biases_per_step(), probe.counts, ref, 2, LOCAL_BATCH * SEQ)


@dataclass(frozen=True)
class Case:
    name: str
    layout: tuple[int, int, int]  # (TP, EP, ETP)
    accumulate: int = 1
    recompute: bool = False
    user_updater: bool = False
    overrides: tuple = ()

    @property
    def dp(self) -> int:
        return WORLD // self.layout[0]


CASES = [
    Case("ep2", (1, 2, 1)),
    Case("ep2-accum2-user-updater", (1, 2, 1), accumulate=2, user_updater=True),
    Case("ep2-accum2-recompute", (1, 2, 1), accumulate=2, recompute=True),
]
GLOBAL_AUX = Case(
    "ep2-global-aux-accum2",
    (1, 2, 1),
    accumulate=2,
    overrides=(("expert_bias", False), ("load_balancing", ["global_aux_loss"]), ("aux_loss_coeff", 1e-2)),
)
PLAIN = Case("ep2-no-bias", (1, 2, 1), overrides=(("expert_bias", False),))


def _fit(case: Case, steps: int = STEPS) -> dict:
    tp, ep, etp = case.layout
    module, probe = BiasModule(case.recompute, **dict(case.overrides)), Probe()
    user = ExpertBiasUpdater()
    callbacks = [probe, user] if case.user_updater else [probe]
    strategy = MoEStrategy(tensor_parallel_size=tp, expert_parallel_size=ep, expert_tensor_parallel_size=etp)
    trainer = L.Trainer(
        **quiet_trainer_kwargs(devices=WORLD, strategy=strategy, max_steps=steps, callbacks=callbacks),
        accumulate_grad_batches=case.accumulate,
    )
    trainer.fit(module, DataLoader(make_dataset(), batch_size=LOCAL_BATCH, shuffle=False))
    updaters = [cb for cb in trainer.callbacks if isinstance(cb, ExpertBiasUpdater)]
    return {
        "global_step": trainer.global_step,
        "counts": probe.counts,
        "biases": probe.biases_per_step(),
        "aux_steps": [s for _, _, s in probe.after_batch],
        "num_updaters": len(updaters),
        "user_updater_kept": user in updaters,
        "sizes": {n: strategy.parallel_context.size(n) for n in ("tp", "dp", "ep")},
    }


def _all_fits(rank: int, world_size: int) -> dict:
    results = {case.name: _fit(case) for case in CASES}
    results[GLOBAL_AUX.name] = _fit(GLOBAL_AUX)
    results[PLAIN.name] = _fit(PLAIN, steps=1)
    return results


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    return run_distributed(_all_fits, WORLD, timeout_s=240, tmp_dir=tmp_path_factory.mktemp("expert_bias"))


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_biases_equal_single_device_sign_rule(fits, case):
    """Per step: the local counts summed over all ranks (TP x DP x CP = the world here) equal the
    oracle's exactly, and every rank's biases equal the oracle's bit for bit."""
    ref = reference_run(case.accumulate, case.dp)
    ranks = [r[case.name] for r in fits]
    assert ranks[0]["sizes"] == {"tp": case.layout[0], "dp": case.dp, "ep": case.layout[1]}
    summed = [
        {
            name: [sum(vals) for vals in zip(*(r["counts"][step][name] for r in ranks))]
            for name in LAYER_SHAPES
        }
        for step in range(len(ranks[0]["counts"]))
    ]
    for r in ranks:
        assert r["global_step"] == STEPS
        _assert_matches_reference(r["biases"], summed, ref, case.accumulate, case.dp * LOCAL_BATCH * SEQ)


@pytest.mark.distributed
@pytest.mark.parametrize("case", [*CASES, GLOBAL_AUX, PLAIN], ids=lambda c: c.name)
def test_strategy_adds_the_updater_once_when_needed(fits, case):
    for r in fits:
        assert r[case.name]["num_updaters"] == (0 if case is PLAIN else 1)
        assert r[case.name]["user_updater_kept"] == case.user_updater


@pytest.mark.distributed
def test_global_aux_loss_state_reset_after_each_global_batch(fits):
    """Within a global batch the running statistics accumulate (1 after the first of 2 micro-batches);
    after the optimizer step they are reset (0)."""
    for r in fits:
        assert r[GLOBAL_AUX.name]["global_step"] == STEPS
        assert r[GLOBAL_AUX.name]["aux_steps"] == [1, 0] * STEPS
