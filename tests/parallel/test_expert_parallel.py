"""Expert parallelism (`parallelize` / `apply_expert_parallel`) against the one-device `MoELayer`.

Every test forks gloo ranks; each rank builds the one-device layer from a seed, copies it,
parallelises the copy and runs its own tokens through it. Because all ranks' tokens come from one
seeded generator, each rank also computes the oracle of docs/architecture.md §9 by itself
(``ep_oracles.py``) and reports measured differences; the parent checks them against the named
tolerances and lists every failing (case, rank, quantity) at once. Several cases run per launch.

Layouts (sizes; ``etp`` defaults to ``tp``): EP=2 (world 2); EP=4; EP=2, ETP=2; TP=2, ETP=1, EP=4
(folded: dense DP=2, EDP=1; each rank holds distinct tokens, as under sequence parallelism).
Aux-loss tests add CP=2, EP=4 (the TP x CP token group is then the CP group). Dispatchers:
``alltoall``, ``allgather`` and ``flex`` (its torch backend; ``test_flex_dispatcher.py`` has the
rest of flex) run every parity and edge case.

What is compared, per case:

* dropless: every rank's output rows and input gradient equal the one-device layer on the
  gathered batch; router and shared-expert gradients summed over all ranks, and every local
  expert's gradients summed over the expert-DP group, equal the one-device gradients (expert
  tensors sliced by hand to the rank's experts and ETP blocks);
* capacity dropping (both policies) and drop-and-pad: the same, with the oracle applied to each
  rank's own tokens (capacity is per rank, as upstream) and gradients summed over the ranks;
* expert-bias counts summed over TP x DP x CP (every rank here) equal the oracle's counts;
* `DispatchStats` of the forward pass equal the numbers implied by the oracle's routing maps
  (``ep_oracles.expected_dispatch_stats``);
* router losses (aux, seq aux, z, global aux): logged values and router/input gradients against
  the one-device layer per TP x CP token group (aux, seq aux), per rank with ``coeff / |TP x CP|``
  (z-loss) or over every rank (global aux, with the DP factor its docstring documents).
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
    expected_dispatch_stats,
    expert_block,
    layer_grads,
    make_tokens,
    reference_with,
    run_reference,
    split_rows,
)
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_moe.layers.activations import is_gated
from lightning_moe.layers.config import MoEConfig
from lightning_moe.layers.permute import pad_routing_map
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize

pytestmark = pytest.mark.distributed

HIDDEN, FFN, NUM_EXPERTS, TOP_K, SHARED_FFN = 16, 8, 8, 2, 12
# A launch of 4 ranks with ~10 small cases takes 1-3 s; generous for a loaded 2-core machine.
LAUNCH_TIMEOUT_S = 120.0

LAYOUTS = {
    "ep2": (2, {"ep": 2}),
    "ep4": (4, {"ep": 4}),
    "ep2_etp2": (4, {"ep": 2, "etp": 2}),
    "tp2_etp1_ep4": (4, {"tp": 2, "etp": 1, "ep": 4}),
}
AUX_LAYOUTS = {
    "ep2": LAYOUTS["ep2"],
    "tp2_etp1_ep4": LAYOUTS["tp2_etp1_ep4"],
    "cp2_ep4": (4, {"cp": 2, "ep": 4}),
}
DISPATCHERS = ("alltoall", "allgather", "flex")

# Uneven token counts per rank (dropless and capacity dropping); drop-and-pad needs equal ones.
UNEVEN_TOKENS = {2: (5, 9), 4: (5, 9, 4, 7)}
PAD_TOKENS = 12
# Large enough next to sigmoid scores in (0, 1) to decide every selection.
FORCING_BIAS = 10.0
EXPERT_BIAS_STD = 0.2
# Dead experts under softmax: feature 0 of every token is shifted by DEAD_OFFSET and the dead
# experts' router weight on it set to DEAD_WEIGHT, so their logits sit ~12 below the others.
DEAD_OFFSET, DEAD_WEIGHT = 4.0, -3.0


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration run on every rank of a launch."""

    name: str
    dispatcher: str
    config: tuple[tuple[str, object], ...] = ()
    """MoEConfig overrides of the base config (hidden 16, ffn 8, 8 experts, top-2)."""
    oracle: str = "global"
    """``global``: one-device layer on the gathered batch; ``per_rank``: on each rank's tokens."""
    tokens: tuple[int, ...] | None = None
    """Tokens per rank; default `UNEVEN_TOKENS` (`PAD_TOKENS` each with ``pad_to_capacity``)."""
    bias: str = "none"
    """Expert bias of the reference: ``none``, ``random`` or ``force_last`` (+10 on the experts
    of the last EP rank, so every token goes there)."""
    dead: str = "none"
    """``first_ep_rank``: the experts of EP rank 0 never receive a token (softmax routing)."""
    kernel: str = "auto"
    """Expert kernel of the parallel layer (``auto`` is the per-expert loop on CPU)."""
    seed: int = 0

    def moe_config(self) -> MoEConfig:
        settings = {
            "hidden_size": HIDDEN,
            "ffn_hidden_size": FFN,
            "num_experts": NUM_EXPERTS,
            "top_k": TOP_K,
            "init_std": INIT_STD,
        }
        settings.update(dict(self.config))
        return MoEConfig(**settings)


# ---------------------------------------------------------------------------------------------
# Rank-side checks. Each returns a list of (case, quantity, kind, a, b) rows:
#   kind "out"/"grad": a = max abs error, b = max |reference| (checked against the tolerance);
#   kind "exact": a = actual, b = expected (ints / lists, compared with ==).


def _close(rows, case, what, kind, actual, expected):
    result = compare(actual, expected)
    rows.append((case, what, kind, result.err, result.scale))


def _exact(rows, case, what, actual, expected):
    rows.append((case, what, "exact", actual, expected))


def _sum_over(tensor: torch.Tensor, group) -> torch.Tensor:
    tensor = tensor.detach().clone()
    dist.all_reduce(tensor, group=group)
    return tensor


def _reference_layer(case: Case, config: MoEConfig, ep_size: int):
    num_experts, num_local = config.num_experts, config.num_experts // ep_size
    bias = None
    if case.bias == "random":
        gen = torch.Generator().manual_seed(case.seed + 1000)
        bias = torch.randn(num_experts, generator=gen) * EXPERT_BIAS_STD
    elif case.bias == "force_last":
        bias = torch.zeros(num_experts)
        bias[num_experts - num_local :] = FORCING_BIAS
    ref = build_reference(config, case.seed, bias)
    if ref.experts.fc2_bias is not None:  # zero at init: make it count
        gen = torch.Generator().manual_seed(case.seed + 2000)
        with torch.no_grad():
            ref.experts.fc2_bias.copy_(torch.randn(ref.experts.fc2_bias.shape, generator=gen) * INIT_STD)
    if case.dead == "first_ep_rank":
        with torch.no_grad():
            ref.router.weight[:num_local, 0] = DEAD_WEIGHT
    return ref


def _check_parity_case(rank: int, world: int, ctx, case: Case) -> list:
    rows: list = []
    name = case.name
    config = case.moe_config()
    dims = ctx.dims
    ep_size, etp_size = ctx.size("ep"), ctx.size("etp")
    num_local = config.num_experts // ep_size
    ep_rank, etp_rank = ctx.rank_in("ep"), ctx.rank_in("etp")
    first = ep_rank * num_local

    ref = _reference_layer(case, config, ep_size)
    layer = copy.deepcopy(ref)
    layer.experts.kernel = case.kernel
    parallelize(layer, ctx, dispatcher=case.dispatcher)

    counts = case.tokens or ((PAD_TOKENS,) * world if config.pad_to_capacity else UNEVEN_TOKENS[world])
    offset = DEAD_OFFSET if case.dead != "none" else 0.0
    xs = make_tokens([(c,) for c in counts], case.seed + 1, HIDDEN, offset)
    dys = make_tokens([(c,) for c in counts], case.seed + 2, HIDDEN)

    # The parallel layer on this rank's tokens.
    x = xs[rank].clone().requires_grad_()
    y = layer(x)
    y.backward(dys[rank])
    stats = layer.dispatcher.stats

    # The oracle.
    if case.oracle == "global":
        y_all, gx_all = run_reference(ref, xs, dys)
        y_ref, gx_ref = split_rows(y_all, list(counts), rank), split_rows(gx_all, list(counts), rank)
    else:
        for r in range(world):
            y_r, gx_r = run_reference(ref, [xs[r]], [dys[r]])
            if r == rank:
                y_ref, gx_ref = y_r, gx_r
    ref_grads = layer_grads(ref)

    _close(rows, name, "output", "out", y, y_ref)
    _close(rows, name, "input grad", "grad", x.grad, gx_ref)
    world_group, edp_group = dist.group.WORLD, ctx.group("edp")
    for pname, param in layer.named_parameters():
        if pname.startswith("experts."):
            short = pname.split(".", 1)[1]
            gated = is_gated(config.activation) and short == "fc1_weight"
            block = expert_block(ref_grads[pname], short, ep_rank, num_local, etp_rank, etp_size, gated)
            _close(
                rows, name, f"{pname} grad (sum over EDP)", "grad", _sum_over(param.grad, edp_group), block
            )
            weights = expert_block(
                ref.get_parameter(pname).detach(), short, ep_rank, num_local, etp_rank, etp_size, gated
            )
            _exact(rows, name, f"{pname} local block", bool(torch.equal(param.detach(), weights)), True)
        else:
            _close(
                rows,
                name,
                f"{pname} grad (sum over ranks)",
                "grad",
                _sum_over(param.grad, world_group),
                ref_grads[pname],
            )
    _exact(rows, name, "expert_offset", layer.experts.expert_offset, first)

    # Expert-bias counts: summed over TP x DP x CP (all ranks) = the oracle's counts.
    summed_counts = _sum_over(layer.router.local_tokens_per_expert, ctx.group("tp_dp_cp"))
    _exact(
        rows,
        name,
        "local_tokens_per_expert (sum)",
        summed_counts.tolist(),
        ref.router.local_tokens_per_expert.tolist(),
    )

    # Routing maps of every rank, as the oracle routes them (per rank: capacity is per rank).
    with torch.no_grad():
        routed = [ref.router(xs[r]) for r in range(world)]
    maps = [m for _, m in routed]
    if config.router_padding_alignment is not None:  # the layer pads the router's map before dispatch
        maps = [pad_routing_map(m, config.router_padding_alignment) for m in maps]

    _exact(rows, name, "stats.dispatches", stats.dispatches, 1)
    for field, expected in expected_dispatch_stats(case.dispatcher, maps, rank, dims, HIDDEN).items():
        _exact(rows, name, f"stats.{field}", getattr(stats, field), expected)
    if config.capacity_factor is None:
        _exact(rows, name, "stats.tokens_dropped", stats.tokens_dropped, None)
    else:
        probs, final_map = routed[rank]
        dropped = counts[rank] * config.top_k - int((final_map & (probs > 0)).sum())
        _exact(rows, name, "stats.tokens_dropped", int(stats.tokens_dropped), dropped)
        rows.append((name, "dropped (premise)", "info", dropped, None))

    # Premises of the edge cases: nothing routed to EP rank 0's experts, anywhere.
    if case.bias == "force_last" or case.dead == "first_ep_rank":
        # EP rank 0 sends all its rows away: one per assignment (alltoall), per (token, rank) (flex).
        by_rank = maps[rank].view(maps[rank].shape[0], ep_size, num_local)
        sent_rows = {"alltoall": int(maps[rank].sum()), "flex": int(by_rank.any(-1).sum())}
        to_first = sum(int(m[:, :num_local].sum()) for m in maps)
        _exact(rows, name, "assignments to EP rank 0's experts (premise)", to_first, 0)
        _exact(
            rows,
            name,
            "stats.rows_sent of EP rank 0 (premise)",
            stats.rows_sent if ep_rank == 0 and case.dispatcher in sent_rows else None,
            sent_rows[case.dispatcher] if ep_rank == 0 and case.dispatcher in sent_rows else None,
        )
    return rows


def _parity_rank(rank: int, world: int, layout: dict, cases: list[Case]) -> list:
    ctx = build_parallel_context(ParallelDims(world, **layout), "cpu")
    rows = []
    for case in cases:
        rows.extend(_check_parity_case(rank, world, ctx, case))
    return rows


# ---------------------------------------------------------------------------------------------
# Parent-side assertion.

_TOLERANCES = {"out": FP32_OUT_TOL, "grad": FP32_GRAD_TOL}


def _assert_rows(per_rank_rows: list[list]) -> list:
    """Fail with every (case, rank, quantity) outside its tolerance; return the rows (with rank)."""
    failures, flat = [], []
    for rank, rows in enumerate(per_rank_rows):
        for case, what, kind, a, b in rows:
            flat.append((rank, case, what, kind, a, b))
            if kind == "exact" and a != b:
                failures.append(f"{case} | rank {rank} | {what}: got {a}, expected {b}")
            elif kind in _TOLERANCES and not a <= _TOLERANCES[kind] * max(b, 1e-12 / _TOLERANCES[kind]):
                failures.append(
                    f"{case} | rank {rank} | {what}: max error {a:.3g} > {_TOLERANCES[kind]:g} x "
                    f"max|ref| {b:.3g}"
                )
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)
    return flat


def _run(fn, layout_name: str, layouts: dict, cases: list, tmp_path) -> list:
    world, layout = layouts[layout_name]
    return _assert_rows(
        run_distributed(fn, world, layout, cases, timeout_s=LAUNCH_TIMEOUT_S, tmp_dir=tmp_path)
    )


# ---------------------------------------------------------------------------------------------
# 1-2, 5: dropless, capacity dropping and drop-and-pad, with DispatchStats.

SHARED = (("shared_expert_ffn_hidden_size", SHARED_FFN), ("shared_expert_gate", True))


def _parity_cases(layout: dict) -> list[Case]:
    etp = layout.get("etp", layout.get("tp", 1))
    cases = []
    for i, dispatcher in enumerate(DISPATCHERS):
        seed = 10 * i
        cases += [
            Case(f"{dispatcher}/dropless softmax + shared", dispatcher, SHARED, seed=seed + 1),
            Case(
                f"{dispatcher}/dropless sigmoid + expert bias",
                dispatcher,
                (("score_func", "sigmoid"), ("expert_bias", True)),
                bias="random",
                seed=seed + 2,
            ),
            Case(
                f"{dispatcher}/capacity probs",
                dispatcher,
                (("capacity_factor", 1.0), ("drop_policy", "probs"), *SHARED),
                oracle="per_rank",
                seed=seed + 3,
            ),
            Case(
                f"{dispatcher}/capacity position",
                dispatcher,
                (("capacity_factor", 1.0), ("drop_policy", "position")),
                oracle="per_rank",
                seed=seed + 4,
            ),
            Case(
                f"{dispatcher}/drop-and-pad",
                dispatcher,
                (("capacity_factor", 1.0), ("pad_to_capacity", True), *SHARED),
                oracle="per_rank",
                seed=seed + 5,
            ),
            Case(
                f"{dispatcher}/capacity sigmoid + expert bias",
                dispatcher,
                (("capacity_factor", 1.0), ("score_func", "sigmoid"), ("expert_bias", True)),
                oracle="per_rank",
                bias="random",
                seed=seed + 6,
            ),
            # fc1 of a plain activation is [E, F, H]: its ETP block is a plain row block.
            Case(f"{dispatcher}/dropless gelu", dispatcher, (("activation", "gelu"),), seed=seed + 7),
            Case(
                f"{dispatcher}/dropless grouped_mm kernel",
                dispatcher,
                SHARED,
                kernel="grouped_mm",
                seed=seed + 8,
            ),
            Case(
                f"{dispatcher}/router padding alignment 4",
                dispatcher,
                (("router_padding_alignment", 4),),
                oracle="per_rank",
                seed=seed + 9,
            ),
        ]
        if etp == 1:  # fc2_bias needs ETP=1 (tested to raise otherwise)
            cases.append(
                Case(f"{dispatcher}/dropless fc2 bias", dispatcher, (("fc2_bias", True),), seed=seed + 10)
            )
    return cases


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_matches_single_device_layer(layout_name, tmp_path):
    rows = _run(_parity_rank, layout_name, LAYOUTS, _parity_cases(LAYOUTS[layout_name][1]), tmp_path)
    # The capacity cases must actually drop something, or they would only repeat the dropless ones.
    dropped = {}
    for _, case, _what, kind, a, _ in rows:
        if kind == "info":
            dropped[case] = dropped.get(case, 0) + a
    assert dropped and all(total > 0 for case, total in dropped.items() if "capacity" in case), dropped


# ---------------------------------------------------------------------------------------------
# 3: edge cases.


def _edge_cases(world: int, layout: dict) -> list[Case]:
    ep = layout["ep"]
    zero_rank_tokens = (0, 9) if world == 2 else (3, 7, 0, 5)
    # One local expert per rank: E == EP (top-1 sigmoid for E == 2, where top-2 would pick both).
    one_per_rank = (
        (("num_experts", ep), ("top_k", 1), ("score_func", "sigmoid")) if ep == 2 else (("num_experts", ep),)
    )
    cases = []
    for i, dispatcher in enumerate(DISPATCHERS):
        seed = 100 + 10 * i
        cases += [
            Case(
                f"{dispatcher}/all tokens to the last EP rank (sigmoid + bias)",
                dispatcher,
                (("score_func", "sigmoid"), ("expert_bias", True), *SHARED),
                bias="force_last",
                seed=seed + 1,
            ),
            Case(
                f"{dispatcher}/all tokens to the last EP rank, grouped_mm kernel",
                dispatcher,
                (("score_func", "sigmoid"), ("expert_bias", True)),
                bias="force_last",
                kernel="grouped_mm",
                seed=seed + 7,
            ),
            Case(
                f"{dispatcher}/EP rank 0's experts get no token (softmax)",
                dispatcher,
                SHARED,
                dead="first_ep_rank",
                seed=seed + 2,
            ),
            Case(
                f"{dispatcher}/a rank with zero tokens",
                dispatcher,
                SHARED,
                tokens=zero_rank_tokens,
                seed=seed + 3,
            ),
            Case(
                f"{dispatcher}/a rank with zero tokens, capacity",
                dispatcher,
                (("capacity_factor", 1.0),),
                oracle="per_rank",
                tokens=zero_rank_tokens,
                seed=seed + 4,
            ),
            Case(f"{dispatcher}/one local expert per rank", dispatcher, one_per_rank, seed=seed + 5),
            Case(
                f"{dispatcher}/one local expert per rank, drop-and-pad",
                dispatcher,
                (*one_per_rank, ("capacity_factor", 1.0), ("pad_to_capacity", True)),
                oracle="per_rank",
                seed=seed + 6,
            ),
        ]
    return cases


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_edge_cases_match_single_device_layer(layout_name, tmp_path):
    world, layout = LAYOUTS[layout_name]
    _run(_parity_rank, layout_name, LAYOUTS, _edge_cases(world, layout), tmp_path)


# ---------------------------------------------------------------------------------------------
# 4: router losses under expert parallelism.

AUX_BATCH, AUX_SEQ_LOCAL = 2, 6
AUX_COEFF, Z_COEFF = 1e-2, 1e-3
PADDED_FRACTION = 0.3


@dataclasses.dataclass(frozen=True)
class LossCase:
    name: str
    dispatcher: str
    config: tuple[tuple[str, object], ...]
    unit: str
    """Token unit of the oracle: ``tp_cp`` group, ``rank`` or ``all`` ranks."""
    logged: str
    """Key of ``router.logged_losses()``."""
    microbatches: int = 1
    padding: bool = False
    """Pass a padding mask (about a third of the positions padded)."""
    seed: int = 0


# The flex dispatcher on two of the cases below (its seeds differ, so the routing does too).
_FLEX_LOSS_CASES = {"aux_loss sigmoid + expert bias": 210, "global_aux_loss, 2 micro-batches": 211}


def _loss_cases() -> list[LossCase]:
    cases = _base_loss_cases()
    return cases + [
        dataclasses.replace(case, name=f"flex: {case.name}", dispatcher="flex", seed=_FLEX_LOSS_CASES[case.name])
        for case in cases if case.name in _FLEX_LOSS_CASES
    ]


def _base_loss_cases() -> list[LossCase]:
    return [
        LossCase(
            "aux_loss softmax",
            "alltoall",
            (("load_balancing", ["aux_loss"]), ("aux_loss_coeff", AUX_COEFF)),
            "tp_cp",
            "load_balancing_loss",
            seed=201,
        ),
        LossCase(
            "aux_loss sigmoid + expert bias",
            "allgather",
            (
                ("load_balancing", ["aux_loss"]),
                ("aux_loss_coeff", AUX_COEFF),
                ("score_func", "sigmoid"),
                ("expert_bias", True),
            ),
            "tp_cp",
            "load_balancing_loss",
            seed=202,
        ),
        LossCase(
            "seq_aux_loss",
            "alltoall",
            (("load_balancing", ["seq_aux_loss"]), ("aux_loss_coeff", AUX_COEFF)),
            "tp_cp",
            "seq_load_balancing_loss",
            seed=203,
        ),
        LossCase("z_loss", "alltoall", (("z_loss_coeff", Z_COEFF),), "rank", "z_loss", seed=204),
        LossCase(
            "global_aux_loss, 2 micro-batches",
            "alltoall",
            (("load_balancing", ["global_aux_loss"]), ("aux_loss_coeff", AUX_COEFF)),
            "all",
            "global_load_balancing_loss",
            microbatches=2,
            seed=205,
        ),
        # With a padding mask N comes from the reduced counts (valid tokens of the group).
        LossCase(
            "aux_loss + padding mask",
            "alltoall",
            (("load_balancing", ["aux_loss"]), ("aux_loss_coeff", AUX_COEFF)),
            "tp_cp",
            "load_balancing_loss",
            padding=True,
            seed=206,
        ),
        LossCase(
            "seq_aux_loss + padding mask",
            "allgather",
            (("load_balancing", ["seq_aux_loss"]), ("aux_loss_coeff", AUX_COEFF)),
            "tp_cp",
            "seq_load_balancing_loss",
            padding=True,
            seed=207,
        ),
        LossCase(
            "z_loss + padding mask",
            "alltoall",
            (("z_loss_coeff", Z_COEFF),),
            "rank",
            "z_loss",
            padding=True,
            seed=208,
        ),
        LossCase(
            "global_aux_loss + padding mask, 2 micro-batches",
            "alltoall",
            (("load_balancing", ["global_aux_loss"]), ("aux_loss_coeff", AUX_COEFF)),
            "all",
            "global_load_balancing_loss",
            microbatches=2,
            padding=True,
            seed=209,
        ),
    ]


def _check_loss_case(rank: int, world: int, ctx, case: LossCase) -> list:
    rows: list = []
    name = case.name
    config = Case(name, case.dispatcher, case.config).moe_config()
    bias = None
    if config.expert_bias:
        bias = (
            torch.randn(config.num_experts, generator=torch.Generator().manual_seed(case.seed))
            * EXPERT_BIAS_STD
        )
    ref = build_reference(config, case.seed, bias)
    layer = copy.deepcopy(ref)
    parallelize(layer, ctx, dispatcher=case.dispatcher)
    layer.router.aux_loss_scale = 1.0
    ref.router.aux_loss_scale = 1.0

    shapes = [(AUX_BATCH, AUX_SEQ_LOCAL)] * world
    batches = [make_tokens(shapes, case.seed + 1 + m, HIDDEN) for m in range(case.microbatches)]
    zeros = [torch.zeros(*s, HIDDEN) for s in shapes]
    masks = [[None] * world for _ in batches]
    if case.padding:
        gen = torch.Generator().manual_seed(case.seed + 500)
        masks = [[torch.rand(s, generator=gen) < PADDED_FRACTION for s in shapes] for _ in batches]
    # Only the attached losses produce gradients: the layer's output gets a zero gradient.
    x_grads = []
    for m, xs in enumerate(batches):
        x = xs[rank].clone().requires_grad_()
        y = layer(x, masks[m][rank])
        y.backward(torch.zeros_like(y))
        x_grads.append(x.grad)
    logged = layer.router.logged_losses()

    # Oracle units and how the losses combine (reference 2.5, 2.6; losses.global_aux_loss).
    dims = ctx.dims
    tp_cp = ctx.size("tp_cp")
    dp = ctx.size("tp_dp_cp") // tp_cp
    if case.unit == "tp_cp":
        units, changes, grad_factor, logged_group = dims.groups("tp_cp"), {}, 1.0, ctx.group("tp_cp")
    elif case.unit == "rank":
        units, changes, grad_factor, logged_group = (
            [[r] for r in range(world)],
            {"z_loss_coeff": Z_COEFF / tp_cp},
            1.0,
            None,
        )
    else:
        # global_aux_loss: each rank attaches DP x its share, so after the DP average of router
        # grads (sum over ranks / DP) the gradient is that of the global-batch loss.
        units, changes, grad_factor, logged_group = [list(range(world))], {}, float(dp), ctx.group("tp_dp_cp")

    router_grad = torch.zeros_like(ref.router.weight)
    ref_counts = torch.zeros_like(ref.router.local_tokens_per_expert)
    for unit in units:
        ref_u = reference_with(ref, **changes)
        for m, xs in enumerate(batches):
            unit_masks = [masks[m][r] for r in unit] if case.padding else None
            _, gx = run_reference(
                ref_u, [xs[r] for r in unit], [zeros[r] for r in unit], cat_dim=1, masks=unit_masks
            )
            if rank in unit:
                expected_gx = split_rows(gx, [AUX_SEQ_LOCAL] * len(unit), unit.index(rank), dim=1)
                _close(
                    rows, name, f"input grad, micro-batch {m}", "grad", x_grads[m], grad_factor * expected_gx
                )
        router_grad += ref_u.router.weight.grad
        ref_counts += ref_u.router.local_tokens_per_expert
        if rank in unit:
            ref_logged = ref_u.router.logged_losses()

    _exact(rows, name, "logged keys", sorted(logged), sorted(ref_logged))
    value = logged[case.logged]
    if logged_group is not None:
        value = _sum_over(value, logged_group)
    _close(
        rows,
        name,
        f"logged {case.logged}" + (" (sum over group)" if logged_group else ""),
        "out",
        value,
        ref_logged[case.logged],
    )
    summed = _sum_over(layer.router.weight.grad, dist.group.WORLD)
    _close(rows, name, "router grad (sum over ranks)", "grad", summed, grad_factor * router_grad)
    counts = _sum_over(layer.router.local_tokens_per_expert, ctx.group("tp_dp_cp"))
    _exact(rows, name, "local_tokens_per_expert (sum)", counts.tolist(), ref_counts.tolist())
    return rows


def _loss_rank(rank: int, world: int, layout: dict, cases: list[LossCase]) -> list:
    ctx = build_parallel_context(ParallelDims(world, **layout), "cpu")
    rows = []
    for case in cases:
        rows.extend(_check_loss_case(rank, world, ctx, case))
    return rows


@pytest.mark.parametrize("layout_name", list(AUX_LAYOUTS))
def test_router_losses_match_single_device_per_token_group(layout_name, tmp_path):
    _run(_loss_rank, layout_name, AUX_LAYOUTS, _loss_cases(), tmp_path)


# ---------------------------------------------------------------------------------------------
# Drop-and-pad with different token counts per rank.


def _uneven_pad_rank(rank: int, world: int, layout: dict, cases: list[Case]) -> list:
    """Like `_parity_rank`, but a `ValueError` (a refused layout) is reported, not raised."""
    try:
        return _parity_rank(rank, world, layout, cases)
    except ValueError as err:
        return [(case.name, "refused", "refused", f"ValueError: {err}", None) for case in cases]


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_drop_and_pad_with_uneven_token_counts_is_exact_or_refused(dispatcher, tmp_path):
    """Drop-and-pad with 8 and 12 tokens on the two ranks (capacity is per rank's token count).

    The all-gather and flex dispatchers exchange the token counts and handle it (exactly). The
    all-to-all one documents that this mode needs equal counts (as upstream); it must then refuse
    with a ValueError on every rank, not crash inside the collective (gloo aborts the process,
    NCCL would hang or read past the buffers).
    """
    case = Case(
        f"{dispatcher}/drop-and-pad, 8 and 12 tokens",
        dispatcher,
        (("capacity_factor", 1.0), ("pad_to_capacity", True), *SHARED),
        oracle="per_rank",
        tokens=(8, 12),
        seed=300,
    )
    world, layout = LAYOUTS["ep2"]
    per_rank = run_distributed(_uneven_pad_rank, world, layout, [case], timeout_s=30, tmp_dir=tmp_path)
    refused = [[row for row in rows if row[2] == "refused"] for rows in per_rank]
    assert dispatcher == "alltoall" or not any(refused), per_rank
    if any(refused):
        assert all(refused), f"only some ranks refused: {per_rank}"
    else:
        _assert_rows(per_rank)


# ---------------------------------------------------------------------------------------------
# User-facing errors (one process, fake backend: nothing is communicated before they are raised).


@pytest.fixture
def fake_context():
    """``make(world, **layout)``: a `ParallelContext` of rank 0 on a fake process group."""

    def make(world: int, **layout) -> object:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        return build_parallel_context(ParallelDims(world, **layout), "cpu")

    yield make
    if dist.is_initialized():  # forked ranks of later tests must not inherit it
        dist.destroy_process_group()


def _small_layer(**overrides):
    return build_reference(Case("errors", "alltoall", tuple(overrides.items())).moe_config(), seed=0)


@pytest.mark.parametrize(
    ("world", "layout", "overrides", "match"),
    [
        (4, {"ep": 4}, {"num_experts": 6, "top_k": 2}, r"num_experts=6 is not divisible by ep=4"),
        (
            6,
            {"ep": 2, "etp": 3},
            {},
            r"ffn_hidden_size=8 is not divisible by the expert tensor parallel size 3",
        ),
    ],
)
def test_invalid_layouts_raise(fake_context, world, layout, overrides, match):
    ctx = fake_context(world, **layout)
    with pytest.raises(ValueError, match=match):
        parallelize(_small_layer(**overrides), ctx)


def test_fc2_bias_is_added_by_etp_rank_zero_only(fake_context):
    # Rank 0 is ETP rank 0 of its group: it adds the bias, and the bias's
    # gradient is summed over ETP. The other ranks' side is run by the GPT-OSS parity tests.
    layer = parallelize(_small_layer(fc2_bias=True), fake_context(4, ep=2, etp=2))
    assert layer.experts.adds_fc2_bias and layer.experts.replicated_grad_sum is not None
    assert layer.experts.fc2_bias.shape == (NUM_EXPERTS // 2, layer.config.hidden_size)  # not cut over ETP
    one = parallelize(_small_layer(fc2_bias=True), fake_context(2, ep=2))
    assert one.experts.adds_fc2_bias and one.experts.replicated_grad_sum is None


def test_parallelize_twice_raises(fake_context):
    layer = parallelize(_small_layer(), fake_context(2, ep=2))
    with pytest.raises(RuntimeError, match="already applied"):
        parallelize(layer, fake_context(2, ep=2))


def test_unknown_dispatcher_raises_and_leaves_the_model_unchanged(fake_context):
    ctx = fake_context(2, ep=2)
    layer = _small_layer()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"Unknown dispatcher 'all2all'; choose one of \['allgather', 'alltoall', 'flex'\]"
    ):
        parallelize(layer, ctx, dispatcher="all2all")
    # A failed call must not leave a half-parallelised model behind (a retry with the right
    # name would then be refused as "already applied").
    assert layer.experts.num_experts == NUM_EXPERTS and layer.experts.expert_offset == 0
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
    parallelize(layer, ctx, dispatcher="alltoall")
