"""Token dispatchers over expert parallelism: bytes moved and layer time, on forked gloo CPU ranks.

For each EP size, ``EP`` ranks are forked (``tests/helpers/dist.py::run_distributed``), each holding
``--tokens`` tokens of one global batch, and every dispatcher (``alltoall``, ``allgather``,
``flex`` with its torch backend) is measured on the same `MoELayer` (built after
``torch.manual_seed(0)``, so the same weights):

(a) Bytes of one forward dispatch and combine, summed over ranks, from each dispatcher's
    ``DispatchStats`` (payload that leaves a rank; the backward moves the same amounts in reverse),
    against two references computed from the routing maps:

    * routed: one row per (token, expert on another rank), what upstream's all-to-all sends:
      dispatch ``A * (H * b + p)``, combine ``A * H * b``;
    * dedup minimum: one hidden row per (token, other rank holding at least one of its experts),
      plus the probability of every remote assignment: dispatch ``D * H * b + A * p``, combine
      ``D * H * b`` (the remote rank sums its experts' outputs for the token first).

    ``A``: remote (token, expert) assignments, ``D``: (token, remote rank) pairs, ``b``/``p``: bytes
    per hidden / probability element. Routing indices are not counted in the references: the
    ``index MB`` column shows what a dispatcher sends of them in collectives of their own (flex:
    a bitmask of the destination's local experts per row, ``D * ceil(E_local / 8)`` bytes),
    outside the totals and ratios. ``flex`` sends exactly the dedup minimum (ratio 1.000x).

(b) Forward+backward time of the whole layer per dispatcher, against the single-device layer on
    the whole global batch, measured in the same run with the cases interleaved (median of
    rounds). Every rank runs every case at the same time (one thread each; the single-device case
    too, so all cases see the same CPU contention), a barrier ends each step, and a round's time
    is the slowest rank's. Every case runs under the same contention (all ranks busy), so perfect
    scaling is a ratio of ``1/EP`` even with more ranks than cores; the gap to it is routing,
    permutation and communication overhead (gloo over loopback here) and load imbalance.
    Each dispatcher's output is also checked against the single-device layer (max abs error): an
    error that is NaN, infinite or above ``ERROR_TOL`` times the largest output marks the row
    ``FAIL`` and the script exits with status 1 after printing every table.

    python benchmarks/dispatch.py                       # EP=2 and EP=4, default config
    python benchmarks/dispatch.py --ep 2 --tokens 256 --rounds 3 --output /tmp/dispatch.md
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import platform
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # timing
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))  # helpers

from helpers.asserts import exceeds, worst_error
from helpers.dist import run_distributed
from timing import Case, ratio_table, run_interleaved, write_tables

from lightning_moe import MoEConfig
from lightning_moe.layers.moe import MoELayer
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize
from lightning_moe.parallel.dispatchers import DISPATCHERS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ERROR_TOL = {"fp32": 1e-5, "bf16": 1e-2}
"""Largest output error against the single-device layer, relative to its largest output: the same
math summed in another order (fp32 rounding; bf16 rounding of every product and partial sum)."""
SINGLE = "single-device"


def _routing_references(router, tokens: torch.Tensor, ep_size: int, ep_rank: int) -> dict[str, int]:
    """Remote assignments ``A`` and (token, remote rank) pairs ``D`` of this rank's tokens."""
    with torch.no_grad():  # no router side effects (statistics buffers) outside training steps
        probs, routing_map = router(tokens)
    per_rank = routing_map.view(routing_map.shape[0], ep_size, -1)  # [T, EP, local experts]
    remote = torch.ones(ep_size, dtype=torch.bool)
    remote[ep_rank] = False
    return {
        "assignments": int(per_rank[:, remote].sum()),
        "token_rank_pairs": int(per_rank[:, remote].any(-1).sum()),
        "prob_bytes": probs.element_size(),
    }


def _bench_rank(rank: int, world_size: int, config: MoEConfig, tokens: int, dtype: torch.dtype,
                rounds: int, warmup: int) -> dict:
    torch.manual_seed(0)
    single = MoELayer(config, dtype=dtype)
    ctx = build_parallel_context(ParallelDims(world_size, ep=world_size), "cpu")
    layers = {name: parallelize(copy.deepcopy(single), ctx, dispatcher=name) for name in DISPATCHERS}

    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(world_size * tokens, config.hidden_size, generator=gen).to(dtype)
    g_all = torch.randn(world_size * tokens, config.hidden_size, generator=gen).to(dtype)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    x, g = x_all[mine], g_all[mine]

    # (a) bytes of one forward, and the output against the single-device layer.
    with torch.no_grad():
        expected = single(x_all)[mine]
    result: dict = {"bytes": {}, "error": {}, "times": {}}
    for name, layer in layers.items():
        layer.dispatcher.stats.reset()
        out = layer(x.clone().requires_grad_())
        stats = layer.dispatcher.stats.reset()
        assert stats.dispatches == 1, stats
        result["bytes"][name] = {"dispatch": stats.dispatch_bytes, "combine": stats.combine_bytes,
                                 "rows": stats.rows_sent, "index": stats.dispatch_index_bytes}
        # torch's max propagates NaN (Python's max() would not): a NaN output is a NaN error.
        result["error"][name] = (out.detach().float() - expected.float()).abs().max().item()
    result["scale"] = expected.float().abs().max().item()
    result["refs"] = _routing_references(single.router, x, world_size, rank)
    result["hidden_bytes"] = config.hidden_size * x.element_size()

    # (b) forward+backward time, cases interleaved; the barrier makes a step last until all ranks are done.
    def step_of(layer, inputs, grad):
        def step() -> None:
            layer.zero_grad(set_to_none=True)
            layer(inputs.detach().requires_grad_()).backward(grad)
            dist.barrier()

        return step

    cases = [Case(SINGLE, step_of(single, x_all, g_all))]
    cases += [Case(name, step_of(layer, x, g)) for name, layer in layers.items()]
    run_interleaved(cases, rounds=rounds, warmup=warmup)
    result["times"] = {case.name: case.times for case in cases}
    return result


def worst_errors(per_rank: list[dict]) -> dict[str, float]:
    """Each dispatcher's largest output error over the ranks, NaN when any rank's is NaN."""
    return {name: functools.reduce(worst_error, (r["error"][name] for r in per_rank), 0.0)
            for name in per_rank[0]["error"]}


def error_failures(per_rank: list[dict], tol: float) -> list[str]:
    """The dispatchers whose output error on some rank is NaN, infinite or above ``tol`` times that
    rank's largest single-device output."""
    return [name for name in per_rank[0]["error"]
            if any(exceeds(r["error"][name], tol * r["scale"]) for r in per_rank)]


def _bytes_table(ep: int, per_rank: list[dict], tol: float) -> str:
    """Forward bytes per dispatcher against the routed and dedup references (sums over ranks)."""
    hidden_bytes = per_rank[0]["hidden_bytes"]
    prob_bytes = per_rank[0]["refs"]["prob_bytes"]
    a = sum(r["refs"]["assignments"] for r in per_rank)
    d = sum(r["refs"]["token_rank_pairs"] for r in per_rank)
    routed = a * (hidden_bytes + prob_bytes) + a * hidden_bytes
    dedup = d * hidden_bytes + a * prob_bytes + d * hidden_bytes
    lines = [
        f"### EP={ep}: forward dispatch + combine bytes (all ranks)",
        "",
        f"Routed reference: {a} remote (token, expert) rows, {routed / 1e6:.3f} MB; dedup minimum: "
        f"{d} (token, remote rank) rows, {dedup / 1e6:.3f} MB.",
        "",
        "| dispatcher | rows sent | dispatch MB | combine MB | total MB | vs routed | vs dedup min | index MB "
        "| max abs err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    errors, failed = worst_errors(per_rank), error_failures(per_rank, tol)
    for name in per_rank[0]["bytes"]:
        rows = sum(r["bytes"][name]["rows"] for r in per_rank)
        sent = sum(r["bytes"][name]["dispatch"] for r in per_rank)
        back = sum(r["bytes"][name]["combine"] for r in per_rank)
        index = sum(r["bytes"][name]["index"] for r in per_rank)
        verdict = " FAIL" if name in failed else ""
        lines.append(
            f"| {name} | {rows} | {sent / 1e6:.3f} | {back / 1e6:.3f} | {(sent + back) / 1e6:.3f} | "
            f"{(sent + back) / routed:.3f}x | {(sent + back) / dedup:.3f}x | {index / 1e6:.3f} | "
            f"{errors[name]:.1e}{verdict} |"
        )
    return "\n".join(lines)


def _time_table(ep: int, tokens: int, per_rank: list[dict]) -> str:
    """Per-round slowest-rank times, as a ratio table against the single-device layer."""
    cases = []
    for name in per_rank[0]["times"]:
        case = Case(name, lambda: None)
        case.times = [max(ts) for ts in zip(*(r["times"][name] for r in per_rank))]
        if name == SINGLE:
            case.notes = f"{ep * tokens} tokens on one rank (every rank runs it)"
        else:
            case.notes = f"{tokens} tokens per rank; ideal ratio {1 / ep:.3f}x"
        cases.append(case)
    title = f"EP={ep}: forward+backward time against the single-device layer (global batch {ep * tokens} tokens)"
    table = ratio_table(title, cases, cases[0])
    spread = {c.name: statistics.pstdev(c.times) / c.median for c in cases}
    return table + "\n\nRound-to-round spread (stdev / median): " + ", ".join(
        f"{k} {v:.0%}" for k, v in spread.items()
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", default="2,4", help="comma-separated EP sizes (one forked rank per EP rank)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=128, help="expert ffn hidden size")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--score-func", default="softmax", choices=["softmax", "sigmoid", "sqrtsoftplus"])
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per EP size before the ranks are killed")
    parser.add_argument("--output", default="", help="also write the tables to this markdown file")
    args = parser.parse_args(argv)

    config = MoEConfig(args.hidden, args.ffn, args.experts, top_k=args.top_k, score_func=args.score_func)
    header = (
        f"Command: `python benchmarks/dispatch.py {' '.join(argv if argv is not None else sys.argv[1:])}`  \n"
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, one thread per rank, "
        f"gloo, torch {torch.__version__}  \n"
        f"Layer: {args.tokens} tokens per rank, hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, "
        f"top-{args.top_k}, {args.score_func} router, {args.dtype}; {args.rounds} rounds, median"
    )
    tables = [header]
    failures = []
    print(header, flush=True)
    for ep in (int(e) for e in args.ep.split(",")):
        with tempfile.TemporaryDirectory(prefix="dispatch-bench-") as tmp:
            per_rank = run_distributed(
                _bench_rank, ep, config, args.tokens, DTYPES[args.dtype], args.rounds, args.warmup,
                timeout_s=args.timeout, tmp_dir=tmp,
            )
        failures += [f"EP={ep} {name}" for name in error_failures(per_rank, ERROR_TOL[args.dtype])]
        for table in (_bytes_table(ep, per_rank, ERROR_TOL[args.dtype]), _time_table(ep, args.tokens, per_rank)):
            print("\n" + table, flush=True)
            tables.append(table)
    write_tables(args.output, tables)
    if failures:
        sys.exit(f"Output differs from the single-device layer (NaN, infinite or above {ERROR_TOL[args.dtype]:g} of "
                 f"the largest output): {', '.join(failures)}.")


if __name__ == "__main__":
    main()
