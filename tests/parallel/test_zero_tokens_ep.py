"""Expert parallelism (EP=2, 2 gloo ranks) where one rank has zero tokens, with router losses on.

The rank without tokens still takes part in every collective (the dispatch, the combine and the
count reductions of the losses), so it must neither raise nor hang, and its peer's results must
not change. Oracles (``ep_oracles.py``, as in ``test_expert_parallel.py``): the one-device
`MoELayer` applied to each rank's own tokens, the one aux-loss token group of this layout
(TP x CP = 1), with gradients summed over the ranks; for the global aux loss with a padding mask,
the one-device layer on all ranks' tokens (its ``N`` then comes from the reduced counts). Without
a mask, the global aux loss's ``N`` is Megatron's ``T_local x |TP x DP x CP|``: its oracle is the
one-device layer on the rank's tokens with that group size (the empty rank adds no counts).

The parent checks every rank's reported differences against the fp32 tolerances and lists every
failing (case, rank, quantity) at once.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed
from parallel.ep_oracles import (
    FP32_GRAD_TOL,
    FP32_OUT_TOL,
    INIT_STD,
    build_reference,
    compare,
    expert_block,
    layer_grads,
    make_tokens,
    reference_with,
    run_reference,
)

from lightning_moe.layers.activations import is_gated
from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.router import RouterReduction
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize

pytestmark = pytest.mark.distributed

WORLD, LAYOUT = 2, {"ep": 2}
HIDDEN, FFN, NUM_EXPERTS, TOP_K, SHARED_FFN = 16, 8, 8, 2, 12
AUX_COEFF, Z_COEFF = 1e-2, 1e-3
PADDED_FRACTION = 0.3
LAUNCH_TIMEOUT_S = 120.0
DISPATCHERS = ("alltoall", "allgather")
# Token shapes per rank (without H): rank 0 or rank 1 empty, flat [T, H] or [B, S, H] inputs.
SHAPES = {
    "[0, H] | [9, H]": ((0,), (9,)),
    "[2, 6, H] | [2, 0, H]": ((2, 6), (2, 0)),
    "[0, 6, H] | [2, 6, H]": ((0, 6), (2, 6)),
}
_LOGGED = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


@dataclasses.dataclass(frozen=True)
class ZeroCase:
    """One configuration run on both ranks; ``loss`` is a load-balancing type or ``z_loss``."""

    name: str
    dispatcher: str
    loss: str
    shapes: str
    config: tuple[tuple[str, object], ...] = ()
    padding: bool = False
    kernel: str = "auto"
    seed: int = 0

    def moe_config(self) -> MoEConfig:
        settings: dict = {
            "hidden_size": HIDDEN, "ffn_hidden_size": FFN, "num_experts": NUM_EXPERTS, "top_k": TOP_K,
            "init_std": INIT_STD,
        }
        if self.loss == "z_loss":
            settings["z_loss_coeff"] = Z_COEFF
        else:
            settings.update(load_balancing=[self.loss], aux_loss_coeff=AUX_COEFF)
        settings.update(dict(self.config))
        return MoEConfig(**settings)

    @property
    def logged(self) -> str:
        return "z_loss" if self.loss == "z_loss" else _LOGGED[self.loss]


def _cases() -> list[ZeroCase]:
    shared = (("shared_expert_ffn_hidden_size", SHARED_FFN), ("shared_expert_gate", True))
    sigmoid_bias = (("score_func", "sigmoid"), ("expert_bias", True))
    cases = []
    for d, dispatcher in enumerate(DISPATCHERS):
        for s, shapes in enumerate(SHAPES):
            seed = 100 * d + 10 * s
            cases += [
                ZeroCase(f"{dispatcher}/{shapes}/aux_loss + shared", dispatcher, "aux_loss", shapes, shared,
                         seed=seed + 1),
                ZeroCase(f"{dispatcher}/{shapes}/seq_aux_loss", dispatcher, "seq_aux_loss", shapes, seed=seed + 2),
                ZeroCase(f"{dispatcher}/{shapes}/z_loss", dispatcher, "z_loss", shapes, seed=seed + 3),
                ZeroCase(f"{dispatcher}/{shapes}/global_aux_loss", dispatcher, "global_aux_loss", shapes,
                         seed=seed + 4),
                ZeroCase(f"{dispatcher}/{shapes}/global_aux_loss + padding mask", dispatcher, "global_aux_loss",
                         shapes, padding=True, seed=seed + 5),
                ZeroCase(f"{dispatcher}/{shapes}/aux_loss + padding mask, sigmoid + expert bias", dispatcher,
                         "aux_loss", shapes, sigmoid_bias, padding=True, seed=seed + 6),
                ZeroCase(f"{dispatcher}/{shapes}/aux_loss, capacity", dispatcher, "aux_loss", shapes,
                         (("capacity_factor", 1.0),), seed=seed + 7),
                ZeroCase(f"{dispatcher}/{shapes}/seq_aux_loss, grouped_mm kernel", dispatcher, "seq_aux_loss",
                         shapes, kernel="grouped_mm", seed=seed + 8),
            ]
    return cases


def _sum_over(tensor: torch.Tensor, group=None) -> torch.Tensor:
    tensor = tensor.detach().clone()
    dist.all_reduce(tensor, group=group)
    return tensor


def _inputs(case: ZeroCase):
    shapes = SHAPES[case.shapes]
    xs = make_tokens(list(shapes), case.seed + 1, HIDDEN)
    dys = make_tokens(list(shapes), case.seed + 2, HIDDEN)
    masks = [None] * WORLD
    if case.padding:
        gen = torch.Generator().manual_seed(case.seed + 3)
        masks = [torch.rand(shape, generator=gen) < PADDED_FRACTION for shape in shapes]
    return xs, dys, masks


def _oracle(case: ZeroCase, ref, xs, dys, masks, rank: int):
    """``(output, input grad, logged value, parameter grads, expert-bias counts)`` of the oracle."""
    if case.loss == "global_aux_loss" and case.padding:
        # One unit of all ranks' tokens: those of the rank that has any (the other adds nothing).
        # Each rank attaches DP x its share (losses.global_aux_loss): a coefficient DP x larger in
        # the oracle gives the same gradients (the logged value is coefficient-free).
        (full,) = [r for r in range(WORLD) if xs[r].numel()]
        unit = reference_with(ref, aux_loss_coeff=AUX_COEFF * WORLD)
        y, gx = run_reference(unit, [xs[full]], [dys[full]], masks=[masks[full]])
        if rank != full:
            y, gx = torch.zeros_like(xs[rank]), torch.zeros_like(xs[rank])
        logged = unit.router.logged_losses()[case.logged]
        return y, gx, logged, layer_grads(unit), unit.router.local_tokens_per_expert.clone(), True
    # Per rank: the aux-loss unit (TP x CP = 1), z-loss, capacity and global aux without a mask.
    grads, counts, own = None, None, None
    for r in range(WORLD):
        unit = reference_with(ref)
        if case.loss == "global_aux_loss":
            # Megatron's N = T_local x |TP x DP x CP| and DP x the share attached (see module docstring).
            unit.router.reduction = RouterReduction(tp_cp_size=1, tp_dp_cp_size=WORLD)
        y, gx = run_reference(unit, [xs[r]], [dys[r]], masks=None if masks[r] is None else [masks[r]])
        logged = unit.router.logged_losses()[case.logged]
        unit_grads = layer_grads(unit)
        grads = unit_grads if grads is None else {k: grads[k] + v for k, v in unit_grads.items()}
        unit_counts = unit.router.local_tokens_per_expert.clone()
        counts = unit_counts if counts is None else counts + unit_counts
        if r == rank:
            own = (y, gx, logged)
    return (*own, grads, counts, False)


def _check(rank: int, ctx, case: ZeroCase) -> list:
    rows: list = []

    def close(what, kind, actual, expected):
        result = compare(actual, expected)
        rows.append((case.name, what, kind, result.err, result.scale))

    config = case.moe_config()
    ep_rank, num_local = ctx.rank_in("ep"), config.num_experts // ctx.size("ep")
    bias = None
    if config.expert_bias:
        bias = torch.randn(config.num_experts, generator=torch.Generator().manual_seed(case.seed)) * 0.2
    ref = build_reference(config, case.seed, bias)
    ref.router.aux_loss_scale = 1.0
    layer = copy.deepcopy(ref)
    layer.experts.kernel = case.kernel
    parallelize(layer, ctx, dispatcher=case.dispatcher)
    layer.router.aux_loss_scale = 1.0

    xs, dys, masks = _inputs(case)
    x = xs[rank].clone().requires_grad_()
    y = layer(x, masks[rank])
    y.backward(dys[rank])
    logged = layer.router.logged_losses()

    y_ref, gx_ref, logged_ref, grads_ref, counts_ref, shared_loss = _oracle(case, ref, xs, dys, masks, rank)
    close("output", "out", y, y_ref)
    close("input grad", "grad", x.grad, gx_ref)
    rows.append((case.name, "logged keys", "exact", sorted(logged), [case.logged]))
    value = logged.get(case.logged, torch.tensor(float("nan")))
    rows.append((case.name, f"logged {case.logged} is finite", "exact", bool(torch.isfinite(value)), True))
    if shared_loss:
        close(f"logged {case.logged} (sum over ranks)", "out", _sum_over(value), logged_ref)
    else:
        close(f"logged {case.logged}", "out", value, logged_ref)
    for name, param in layer.named_parameters():
        rows.append((case.name, f"{name} has a grad", "exact", param.grad is not None, True))
        if param.grad is None:
            continue
        if name.startswith("experts."):
            short = name.split(".", 1)[1]
            gated = is_gated(config.activation) and short == "fc1_weight"
            expected = expert_block(grads_ref[name], short, ep_rank, num_local, 0, 1, gated)
            close(f"{name} grad", "grad", param.grad, expected)
        else:
            close(f"{name} grad (sum over ranks)", "grad", _sum_over(param.grad), grads_ref[name])
    counts = _sum_over(layer.router.local_tokens_per_expert)
    rows.append((case.name, "local_tokens_per_expert (sum)", "exact", counts.tolist(), counts_ref.tolist()))
    return rows


def _rank(rank: int, world: int, cases: list[ZeroCase]) -> list:
    ctx = build_parallel_context(ParallelDims(world, **LAYOUT), "cpu")
    rows = []
    for case in cases:
        rows.extend(_check(rank, ctx, case))
    return rows


_TOLERANCES = {"out": FP32_OUT_TOL, "grad": FP32_GRAD_TOL}


def test_a_rank_with_zero_tokens_matches_the_single_device_layer_with_losses(tmp_path):
    per_rank = run_distributed(_rank, WORLD, _cases(), timeout_s=LAUNCH_TIMEOUT_S, tmp_dir=tmp_path)
    failures = []
    for rank, rows in enumerate(per_rank):
        for case, what, kind, a, b in rows:
            if kind == "exact" and a != b:
                failures.append(f"{case} | rank {rank} | {what}: got {a}, expected {b}")
            elif kind in _TOLERANCES and not a <= _TOLERANCES[kind] * max(b, 1e-12 / _TOLERANCES[kind]):
                failures.append(f"{case} | rank {rank} | {what}: max error {a:.3g} > {_TOLERANCES[kind]:g} x {b:.3g}")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)
