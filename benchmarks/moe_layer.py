"""Forward+backward time of `MoELayer` against the GEMM floor and the peers, in one process.

The floor is the work no MoE layer can avoid: the nine expert GEMMs of forward and backward
(gate, up and down projections; their input and weight gradients) as ``grouped_mm`` calls on
perfectly balanced shapes, without routing or activation. Every row is reported as a ratio to
that floor, measured in the same run with the cases interleaved (this machine is noisy).

    python benchmarks/moe_layer.py                 # configs S and M, fp32, every peer installed
    python benchmarks/moe_layer.py --configs S --rounds 3 --peers none

Peers need the ``bench`` extra (``pip install -e ".[bench]"``); missing ones are listed as skipped.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import Case, ratio_table, run_interleaved

from lightning_moe import MoEConfig
from lightning_moe.layers.moe import MoELayer


@dataclass(frozen=True)
class Shape:
    """One benchmark configuration (tokens, hidden, expert ffn, experts, top-k)."""

    name: str
    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int

    @property
    def gemm_flops(self) -> float:
        """FLOPs of the nine expert GEMMs (forward + backward)."""
        return 9 * 2 * self.tokens * self.top_k * self.hidden * self.ffn


SHAPES = {
    "S": Shape("S", 2048, 512, 256, 32, 4),
    "M": Shape("M", 4096, 1024, 512, 64, 8),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def floor_case(shape: Shape, dtype: torch.dtype) -> Case:
    """Nine balanced ``grouped_mm`` calls: 3 forward, 3 input gradients, 3 weight gradients."""
    rows = shape.tokens * shape.top_k
    gen = torch.Generator().manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=gen).to(dtype)

    x, dy, dh = randn(rows, shape.hidden), randn(rows, shape.hidden), randn(rows, shape.ffn)
    w_gate, w_up = randn(shape.experts, shape.hidden, shape.ffn), randn(shape.experts, shape.hidden, shape.ffn)
    w_down = randn(shape.experts, shape.ffn, shape.hidden)
    offs = (torch.arange(1, shape.experts + 1) * (rows // shape.experts)).to(torch.int32)

    def step():
        F.grouped_mm(x, w_gate, offs=offs)
        F.grouped_mm(x, w_up, offs=offs)
        F.grouped_mm(dh, w_down, offs=offs)
        F.grouped_mm(dy, w_down.transpose(-2, -1), offs=offs)
        F.grouped_mm(dh, w_gate.transpose(-2, -1), offs=offs)
        F.grouped_mm(dh, w_up.transpose(-2, -1), offs=offs)
        F.grouped_mm(dy.t(), dh, offs=offs)
        F.grouped_mm(x.t(), dh, offs=offs)
        F.grouped_mm(x.t(), dh, offs=offs)

    return Case("floor: 9 grouped_mm GEMMs", step, "balanced, no routing, no activation")


def module_case(name: str, module: torch.nn.Module, forward, shape: Shape, dtype: torch.dtype, notes: str) -> Case:
    """Forward + backward of ``forward([T, H]) -> [T, H]`` with a fixed upstream gradient."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape.tokens, shape.hidden, generator=gen).to(dtype)
    grad = torch.randn(shape.tokens, shape.hidden, generator=gen).to(dtype)
    params = [p for p in module.parameters() if p.requires_grad]

    def step():
        for p in params:
            p.grad = None
        inp = x.detach().requires_grad_()
        forward(inp).backward(grad)

    return Case(name, step, notes)


def ours_case(shape: Shape, dtype: torch.dtype) -> Case:
    config = MoEConfig(shape.hidden, shape.ffn, shape.experts, top_k=shape.top_k)
    torch.manual_seed(0)
    layer = MoELayer(config).to(dtype)
    kernel = layer.experts.resolved_kernel(torch.device("cpu"))
    return module_case("lightning_moe MoELayer", layer, layer, shape, dtype, f"softmax top-{shape.top_k}, dropless, kernel={kernel}")


def peer_cases(names: list[str], shape: Shape, dtype: torch.dtype) -> tuple[list[Case], dict[str, str]]:
    if not names:
        return [], {}
    import peers

    built, skipped = peers.build_all(
        names, tokens=shape.tokens, hidden=shape.hidden, ffn=shape.ffn, experts=shape.experts,
        top_k=shape.top_k, dtype=dtype, seed=0,
    )
    return [module_case(p.name, p.module, p.forward, shape, dtype, p.notes) for p in built], skipped


def run_suite(shape: Shape, dtype_name: str, peer_names: list[str], rounds: int) -> str:
    dtype = DTYPES[dtype_name]
    floor = floor_case(shape, dtype)
    peers_built, skipped = peer_cases(peer_names, shape, dtype)
    cases = [floor, ours_case(shape, dtype), *peers_built]
    run_interleaved(cases, rounds=rounds, warmup=1)
    title = (
        f"{shape.name} {dtype_name}: tokens {shape.tokens}, hidden {shape.hidden}, ffn {shape.ffn}, "
        f"{shape.experts} experts, top-{shape.top_k} ({rounds} rounds; floor "
        f"{shape.gemm_flops / floor.median / 1e9:.0f} GFLOP/s)"
    )
    table = ratio_table(title, cases, floor)
    if skipped:
        table += "\n\nSkipped: " + "; ".join(f"{k} ({v})" for k, v in skipped.items())
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="S,M", help="comma-separated: S, M")
    parser.add_argument("--dtypes", default="fp32", help="comma-separated: fp32, bf16 (bf16 is ~28x slower on AVX2 CPUs)")
    parser.add_argument("--peers", default="all", help="'all', 'none' or comma-separated peer names")
    parser.add_argument("--rounds", type=int, default=0, help="timed rounds (default: 7 at S, 5 at M)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default="", help="also write the tables to this markdown file")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.peers == "all":
        import peers

        peer_names = list(peers.available_peers())
    else:
        peer_names = [] if args.peers == "none" else args.peers.split(",")
    header = (
        f"Command: `python benchmarks/moe_layer.py {' '.join(argv if argv is not None else sys.argv[1:])}`  \n"
        f"Machine: {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    tables = [header]
    print(header, flush=True)
    for config in args.configs.split(","):
        for dtype_name in args.dtypes.split(","):
            rounds = args.rounds or (7 if config == "S" else 5)
            table = run_suite(SHAPES[config], dtype_name, peer_names, rounds)
            print("\n" + table, flush=True)
            tables.append(table)
    if args.output:
        with open(args.output, "w") as f:
            f.write("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    main()
