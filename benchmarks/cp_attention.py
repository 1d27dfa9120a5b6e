"""Context-parallel attention kernels: forward + backward time per ring-step kernel, as ratios.

One process, a CP group of one (``gloo`` on CPU, ``nccl`` with ``--device cuda``): the ring still
cuts the sequence into its two load-balanced chunks and runs its block kernel and fp32 merge, so
the cases compare the kernels themselves, without communication:

* ``sdpa``: ``scaled_dot_product_attention(is_causal=True)`` on the whole sequence (baseline);
* ``ring fused``: the ring with the device's fused block kernel (PyTorch's fused CPU attention,
  CUDA flash attention in bf16);
* ``ring math``: the ring with fp32 matmul blocks (what the ring computed before it had fused
  kernels, and its fallback);
* ``all_gather``: the all-gather exchange (one masked SDPA).

Times are medians of ``--rounds`` interleaved rounds (``timing.py``); the ratio column is to sdpa.
Compute is fp32 on CPU (bf16 GEMMs are slow on CPUs without bf16 units), ``--dtype`` picks it.

    python benchmarks/cp_attention.py [--seq 2048] [--device cpu|cuda] [--output cp_attention.md]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import Case, ratio_table, run_interleaved, write_tables

from lightning_moe.parallel.context_parallel import context_parallel_attention


def _step(fn, inputs, grad, device: torch.device):
    def step() -> None:
        q, k, v = (t.detach().requires_grad_() for t in inputs)
        fn(q, k, v).backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["fp32", "bf16"], help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--output", default="", help="also write the table to this markdown file")
    args = parser.parse_args()

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    backend = "nccl" if device.type == "cuda" else "gloo"
    extra = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **extra)
    group = dist.new_group([0])
    g = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    inputs = [torch.randn(shape, device=device, dtype=dtype, generator=g) for _ in range(3)]
    grad = torch.randn(shape, device=device, dtype=dtype, generator=g)

    def ring(kernel: str):
        return lambda q, k, v: context_parallel_attention(q, k, v, group, "p2p", block_kernel=kernel)

    cases = [
        Case("sdpa", _step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), inputs, grad, device),
             "whole sequence, causal"),
        Case("ring fused", _step(ring("auto"), inputs, grad, device), "device's fused block kernel"),
        Case("ring math", _step(ring("math"), inputs, grad, device), "fp32 matmul blocks"),
        Case("all_gather", _step(lambda q, k, v: context_parallel_attention(q, k, v, group, "all_gather"),
                                 inputs, grad, device), "one masked SDPA"),
    ]
    run_interleaved(cases, args.rounds)
    title = (f"CP attention kernels, forward + backward, {args.device} {str(dtype).removeprefix('torch.')}, "
             f"B={args.batch} H={args.heads} S={args.seq} D={args.head_dim}, CP group of one")
    table = ratio_table(title, cases, cases[0])
    print(table)
    write_tables(args.output, [table])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
