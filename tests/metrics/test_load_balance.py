"""Tests of the load-balance statistics: router buffers and `ExpertLoadMetric` math.

Oracles are hand-computed: counts from routing decisions written out by hand, entropies with
Python's ``math`` (not the torch code under test), and loss reductions from Megatron-LM's rule
(``reduce_aux_losses_tracker_across_ranks`` in ``megatron/core/transformer/moe/moe_utils.py``)
written as arithmetic on the per-rank values. The heatmap is tested in ``test_heatmap.py``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_moe import MoEConfig
from lightning_moe.layers.router import LOGGED_LOSS_NAMES, TopKRouter
from lightning_moe.layers.router_metrics import METRIC_STAT_NAMES, normalised_scores
from lightning_moe.metrics import ExpertLoadMetric, flatten_for_logging, read_layer_stats

# Counts are exact; fp32 entropies and ratios against float64 Python arithmetic.
FP32_ATOL = 1e-6

# Logits (identity router weight: logits == input) with distinct top-2 per row, E=4, K=2:
# row 0 -> {0, 1}, row 1 -> {1, 2}, row 2 -> {1, 3}, row 3 -> {1, 2}.
LOGITS = torch.tensor(
    [
        [2.0, 1.0, 0.5, -1.0],
        [0.1, 0.3, 0.2, 0.0],
        [-1.0, 3.0, 0.0, 1.0],
        [0.5, 0.6, 2.5, 0.4],
    ]
)
COUNTS = [1, 4, 2, 1]


def _router(**overrides) -> TopKRouter:
    settings = {"hidden_size": 4, "ffn_hidden_size": 8, "num_experts": 4, "top_k": 2, **overrides}
    router = TopKRouter(MoEConfig(**settings))
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    return router.train()


def _entropy(row: list[float], score_func: str = "softmax") -> float:
    """Entropy (nats) of the normalised scores of one row of logits, in plain Python."""
    raw = [math.exp(x) if score_func == "softmax" else 1 / (1 + math.exp(-x)) for x in row]
    total = sum(raw)
    return -sum(r / total * math.log(r / total) for r in raw)


# -- router statistics ---------------------------------------------------------------------------


def test_router_records_counts_and_entropy_of_the_final_map():
    router = _router()
    router(LOGITS)
    stats = router.read_metric_stats()
    assert set(stats) == set(METRIC_STAT_NAMES)
    assert stats["tokens_per_expert"].tolist() == COUNTS
    assert stats["tokens_per_expert"].dtype == torch.int64
    assert (stats["routed"].item(), stats["dropped"].item(), stats["tokens"].item()) == (8, 0, 4)
    expected = sum(_entropy(row) for row in LOGITS.tolist())
    assert stats["entropy_sum"].item() == pytest.approx(expected, abs=FP32_ATOL)
    # reset=True zeroed the buffers; the expert-bias counts are a separate buffer, untouched.
    assert all(v.count_nonzero() == 0 for v in router.read_metric_stats().values())
    assert router.local_tokens_per_expert.tolist() == COUNTS


def test_router_statistics_accumulate_and_read_without_reset():
    router = _router()
    router(LOGITS)
    router(LOGITS[:2])
    stats = router.read_metric_stats(reset=False)
    assert stats["tokens_per_expert"].tolist() == [2, 6, 3, 1]
    assert stats["tokens"].item() == 6
    assert router.read_metric_stats()["tokens_per_expert"].tolist() == [2, 6, 3, 1]


def test_padding_is_excluded():
    router = _router()
    router(LOGITS, padding_mask=torch.tensor([False, False, True, False]))
    stats = router.read_metric_stats()
    assert stats["tokens_per_expert"].tolist() == [1, 3, 2, 0]
    assert (stats["routed"].item(), stats["dropped"].item(), stats["tokens"].item()) == (6, 0, 3)
    expected = sum(_entropy(row) for i, row in enumerate(LOGITS.tolist()) if i != 2)
    assert stats["entropy_sum"].item() == pytest.approx(expected, abs=FP32_ATOL)


def test_capacity_drops_are_counted():
    # capacity = ceil(T*K/E * 0.5) = 1: expert 1 keeps 1 of 4, expert 2 keeps 1 of 2.
    router = _router(capacity_factor=0.5)
    router(LOGITS)
    stats = router.read_metric_stats()
    assert stats["tokens_per_expert"].tolist() == [1, 1, 1, 1]
    assert (stats["routed"].item(), stats["dropped"].item()) == (8, 4)


def test_pad_to_capacity_fillers_are_not_load():
    # capacity = 2: experts 0 and 3 get one filler row each, expert 1 drops 2 of 4.
    router = _router(capacity_factor=1.0, pad_to_capacity=True)
    router(LOGITS)
    stats = router.read_metric_stats()
    assert stats["tokens_per_expert"].tolist() == [1, 2, 2, 1]
    assert stats["dropped"].item() == 2
    assert router.local_tokens_per_expert.tolist() == [1, 2, 2, 1]  # expert-bias counts exclude fillers too


def test_sigmoid_entropy_uses_normalised_scores():
    router = _router(score_func="sigmoid")
    router(LOGITS)
    expected = sum(_entropy(row, "sigmoid") for row in LOGITS.tolist())
    assert router.read_metric_stats()["entropy_sum"].item() == pytest.approx(expected, abs=FP32_ATOL)
    scores = normalised_scores(LOGITS, "sqrtsoftplus")
    torch.testing.assert_close(scores.sum(-1), torch.ones(4))


def test_no_recording_in_eval_or_without_grad_and_once_under_reentrant_recompute():
    router = _router()
    router.eval()(LOGITS)
    router.train()
    with torch.no_grad():
        router(LOGITS)
    assert router.read_metric_stats()["tokens"].item() == 0
    hidden = LOGITS.clone().requires_grad_(True)
    probs, _ = checkpoint(router, hidden, use_reentrant=True)
    probs.sum().backward()
    assert router.read_metric_stats()["tokens_per_expert"].tolist() == COUNTS


def test_entropy_buffer_stays_fp32_under_half():
    router = _router().half()
    assert router.metric_entropy_sum.dtype == torch.float32
    assert router.metric_tokens_per_expert.dtype == torch.int64


def test_normalised_scores_rejects_unknown_score_function():
    with pytest.raises(ValueError, match=r"Unknown score_func 'relu'"):
        normalised_scores(LOGITS, "relu")


# -- ExpertLoadMetric --------------------------------------------------------------------------


def _stats(counts, dropped=0, entropy=0.0, tokens=None, top_k=2) -> dict[str, torch.Tensor]:
    kept = sum(counts)
    routed = kept + dropped
    return {
        "tokens_per_expert": torch.tensor(counts),
        "dropped": torch.tensor(dropped),
        "routed": torch.tensor(routed),
        "entropy_sum": torch.tensor(entropy),
        "tokens": torch.tensor(tokens if tokens is not None else routed // top_k),
    }


def test_metric_math_matches_hand_computed_values():
    metric = ExpertLoadMetric(num_layers=2, num_experts=4)
    metric.update(0, _stats([1, 4, 2, 1], entropy=3.0), dispatch_bytes=100, combine_bytes=60)
    metric.update(0, _stats([1, 0, 2, 1], dropped=2, entropy=2.0), dispatch_bytes=50)
    metric.update(1, _stats([2, 2, 2, 2], entropy=4.0))
    out = metric.compute()
    assert out["tokens_per_expert"].tolist() == [[2, 4, 4, 2], [2, 2, 2, 2]]
    assert out["tokens_per_expert_total"].tolist() == [4, 6, 6, 4]
    # layer 0: max 4 over mean 12/4 = 3; layer 1 balanced.
    torch.testing.assert_close(out["imbalance"], torch.tensor([4 / 3, 1.0]))
    assert out["imbalance_max"].item() == pytest.approx(4 / 3)
    assert out["imbalance_mean"].item() == pytest.approx((4 / 3 + 1) / 2)
    # layer 0: 2 dropped of 14 chosen; overall 2 of 22.
    torch.testing.assert_close(out["dropped_fraction"], torch.tensor([2 / 14, 0.0]))
    assert out["dropped_fraction_total"].item() == pytest.approx(2 / 22)
    # entropy per token: layer 0 (3 + 2) / 7 tokens, layer 1 4 / 4; overall 9 / 11.
    torch.testing.assert_close(out["router_entropy"], torch.tensor([5 / 7, 1.0]))
    assert out["router_entropy_mean"].item() == pytest.approx(9 / 11)
    assert out["tokens"].tolist() == [7, 4]
    assert out["dispatch_bytes"].tolist() == [150, 0] and out["dispatch_bytes_total"].item() == 150
    assert out["combine_bytes"].tolist() == [60, 0]
    assert not any(name in out for name in LOGGED_LOSS_NAMES)  # no loss was recorded
    metric.reset()
    metric.update(1, _stats([0, 0, 0, 0], tokens=0))
    assert torch.isnan(metric.compute()["imbalance"]).all()  # no tokens: undefined, not 0 or inf


def _loss_buffers(values: dict[str, float], micro_batches: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    sums = torch.zeros(len(LOGGED_LOSS_NAMES))
    counts = torch.zeros(len(LOGGED_LOSS_NAMES), dtype=torch.int64)
    for name, value in values.items():
        sums[LOGGED_LOSS_NAMES.index(name)] = value * micro_batches
        counts[LOGGED_LOSS_NAMES.index(name)] = micro_batches
    return sums, counts


@pytest.mark.parametrize(("dp", "tp_cp"), [(1, 2), (2, 1)])
def test_losses_are_reduced_as_megatron_logs_them(dp, tp_cp):
    """Two ranks (merged with torchmetrics' merge_state, which applies the dist reductions)."""
    rank_values = [
        {"load_balancing_loss": 0.6, "global_load_balancing_loss": 0.25, "z_loss": 2.0},
        {"load_balancing_loss": 0.5, "global_load_balancing_loss": 0.75, "z_loss": 4.0},
    ]
    metrics = []
    for values in rank_values:
        metric = ExpertLoadMetric(1, 4, data_parallel_size=dp, tp_cp_size=tp_cp)
        sums, counts = _loss_buffers(values, micro_batches=3)  # mean over 3 micro-batches = the value
        metric.update(0, _stats([1, 1, 1, 1]), loss_sums=sums, loss_counts=counts)
        metrics.append(metric)
    metrics[0].merge_state(metrics[1])
    out = metrics[0].compute()
    # aux: sum over the loss group (each rank holds a share), averaged over DP.
    assert out["load_balancing_loss"].item() == pytest.approx((0.6 + 0.5) / dp)
    # global aux: shares of one loss over TP x DP x CP, summed.
    assert out["global_load_balancing_loss"].item() == pytest.approx(1.0)
    # z-loss: each rank's own mean; Megatron logs z/(TP*CP) summed over TP*CP, averaged over DP.
    assert out["z_loss"].item() == pytest.approx(sum(z / tp_cp for z in (2.0, 4.0)) / dp)
    assert "seq_load_balancing_loss" not in out
    assert out["load_balancing_loss_mean"].item() == pytest.approx(out["load_balancing_loss"].item())
    assert out["tokens_per_expert"].tolist() == [[2, 2, 2, 2]]


def test_loss_mean_over_layers_skips_layers_without_the_loss():
    metric = ExpertLoadMetric(2, 4)
    sums, counts = _loss_buffers({"z_loss": 3.0})
    metric.update(0, _stats([1, 1, 1, 1]), loss_sums=sums, loss_counts=counts)
    metric.update(1, _stats([1, 1, 1, 1]), loss_sums=torch.zeros(4), loss_counts=torch.zeros(4, dtype=torch.int64))
    out = metric.compute()
    assert out["z_loss"][0].item() == pytest.approx(3.0) and math.isnan(out["z_loss"][1].item())
    assert out["z_loss_mean"].item() == pytest.approx(3.0)


def test_update_without_stats_adds_losses_and_bytes_only():
    metric = ExpertLoadMetric(1, 4)
    sums, counts = _loss_buffers({"z_loss": 1.5})
    metric.update(0, None, loss_sums=sums, loss_counts=counts, dispatch_bytes=7)
    metric.update(0, _stats([1, 2, 3, 2]))
    out = metric.compute()
    assert out["tokens_per_expert"].tolist() == [[1, 2, 3, 2]]
    assert out["z_loss"].item() == pytest.approx(1.5) and out["dispatch_bytes"].item() == 7


def test_read_layer_stats_consumes_router_buffers():
    from lightning_moe import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2, z_loss_coeff=1e-3)).train()
    layer(torch.randn(2, 3, 8))
    stats = read_layer_stats(layer)
    assert stats["stats"]["tokens_per_expert"].sum().item() == 12
    assert stats["loss_counts"][LOGGED_LOSS_NAMES.index("z_loss")].item() == 1
    assert "dispatch_bytes" not in stats  # the local dispatcher moves nothing
    assert layer.router.logged_losses() == {}  # consumed
    assert read_layer_stats(layer)["stats"]["tokens"].item() == 0


def test_flatten_for_logging_names():
    metric = ExpertLoadMetric(2, 2)
    sums, counts = _loss_buffers({"load_balancing_loss": 1.25})
    metric.update(0, _stats([3, 1]), loss_sums=sums, loss_counts=counts)
    metric.update(1, _stats([2, 2], dropped=4))
    flat = flatten_for_logging(metric.compute(), prefix="moe/")
    assert flat["moe/imbalance_max"] == pytest.approx(1.5)
    assert flat["moe/layer_0/imbalance"] == pytest.approx(1.5)
    assert flat["moe/layer_1/dropped_fraction"] == pytest.approx(0.5)
    assert flat["moe/load_balancing_loss"] == pytest.approx(1.25)
    assert flat["moe/layer_0/load_balancing_loss"] == pytest.approx(1.25)
    assert math.isnan(flat["moe/layer_1/load_balancing_loss"])
    assert flat["moe/tokens_per_expert/0"] == 5.0 and flat["moe/layer_1/tokens_per_expert/1"] == 2.0
    assert all(isinstance(v, float) for v in flat.values())
    compact = flatten_for_logging(metric.compute(), prefix="x/", per_layer=False, expert_counts=False)
    assert not any("layer_" in k or "tokens_per_expert" in k for k in compact)
    assert set(compact) >= {"x/imbalance_max", "x/dropped_fraction", "x/router_entropy", "x/dispatch_bytes"}


@pytest.mark.parametrize(("layers", "experts"), [(1, 4), (2, 1), (1, 1)], ids=["one-layer", "one-expert", "both"])
def test_one_layer_or_one_expert_keeps_the_documented_shapes(layers, experts):
    """torchmetrics squeezes one-element results ([1] -> []): the metric must undo that for its own."""
    metric = ExpertLoadMetric(layers, experts)
    sums, counts = _loss_buffers({"z_loss": 0.5})
    for layer in range(layers):
        metric.update(layer, _stats([3] * experts, dropped=1, entropy=1.5, tokens=3, top_k=1),
                      loss_sums=sums, loss_counts=counts, dispatch_bytes=8)
    # A copy goes through Metric.__setstate__, which wraps compute() again.
    for out in (metric.compute(), copy.deepcopy(metric).compute()):
        assert out["tokens_per_expert"].shape == (layers, experts)
        assert out["tokens_per_expert"].tolist() == [[3] * experts] * layers
        assert out["tokens_per_expert_total"].tolist() == [3 * layers] * experts
        for name in ("imbalance", "dropped_fraction", "router_entropy", "tokens", "dispatch_bytes",
                     "combine_bytes", "z_loss"):
            assert out[name].shape == (layers,), name
        for name in ("imbalance_max", "dropped_fraction_total", "router_entropy_mean", "z_loss_mean"):
            assert out[name].shape == (), name
        torch.testing.assert_close(out["imbalance"], torch.ones(layers))
        torch.testing.assert_close(out["dropped_fraction"], torch.full((layers,), 1 / (3 * experts + 1)))
    flat = flatten_for_logging(metric.compute())
    assert flat["moe/imbalance_max"] == 1.0
    assert flat["moe/tokens"] == 3.0 * layers
    assert [flat[f"moe/tokens_per_expert/{e}"] for e in range(experts)] == [3.0 * layers] * experts
    assert flat[f"moe/layer_{layers - 1}/tokens_per_expert/{experts - 1}"] == 3.0
    assert flat[f"moe/layer_{layers - 1}/z_loss"] == pytest.approx(0.5)
    assert f"moe/layer_{layers}/imbalance" not in flat


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((0, 4), {}, ValueError, r"positive sizes.*num_layers=0"),
        ((2, 4), {"data_parallel_size": 0}, ValueError, r"data_parallel_size=0"),
    ],
)
def test_metric_constructor_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        ExpertLoadMetric(*args, **kwargs)


def test_metric_update_errors():
    metric = ExpertLoadMetric(2, 4)
    with pytest.raises(IndexError, match=r"layer 2 is out of range for a metric of 2 layers"):
        metric.update(2, _stats([1, 1, 1, 1]))
    with pytest.raises(ValueError, match=r"shape \(2,\), expected \(4,\)"):
        metric.update(0, _stats([1, 1]))

