"""Pipeline bubble of each schedule on CPU, measured against the schedule's theory (``--help``).

On ``P=2`` forked gloo CPU ranks (``tests/helpers/dist.py::run_distributed``, one thread each), a
dense-and-MoE ``MoETransformer`` is split by :class:`~lightning_moe.parallel.pipeline.runner.PipelineRunner`
and one training step (forward, backward, no optimizer) is timed per schedule and micro-batch count
``M`` (fastest of ``--rounds`` after one warm-up: the machine may be shared). The ideal step is the work of one rank without any
wait: ``M`` times its stages' forward and backward of one micro-batch, timed on that rank alone
(no communication). Measured bubble = ``1 - ideal / step`` (the worse rank).

Theory (fraction of the step spent idle, equal stages, communication free): GPipe and 1F1B
``(P-1) / (M+P-1)``; Interleaved1F1B with ``V`` stages per rank ``(P-1) / (V*M+P-1)``;
ZBVZeroBubble 0 when forward, input-backward and weight-backward take equal times (on CPU they
do not, so its measured bubble is shown against 1F1B's theory instead). The ratio column is
measured / theory: 1.0x is the textbook bubble, above it communication and imbalance.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))  # helpers

from helpers.dist import run_distributed

from lightning_moe import MoEConfig
from lightning_moe.layers.loss_scale import set_aux_loss_scale
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.models.transformer import next_token_loss
from lightning_moe.parallel import ParallelDims, build_parallel_context
from lightning_moe.parallel.pipeline.runner import PIPELINE_SCHEDULES, PipelineRunner

P = 2


def theory(schedule: str, m: int, v: int) -> float:
    """Idle fraction of a step by the textbook formula (see the module docstring)."""
    if schedule == "Interleaved1F1B":
        return (P - 1) / (v * m + P - 1)
    return (P - 1) / (m + P - 1)


def _config(hidden: int, seq: int) -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=256, hidden_size=hidden, num_layers=4, num_attention_heads=4, ffn_hidden_size=2 * hidden,
        first_dense_layers=0, max_seq_len=seq,
        moe=MoEConfig(hidden, hidden, 4, top_k=2, load_balancing=["aux_loss"], aux_loss_coeff=1e-2),
    )


def _ideal(runner: PipelineRunner, micro: torch.Tensor, targets: torch.Tensor) -> float:
    """One micro-batch's forward + backward through this rank's stages alone (seconds)."""
    start = time.perf_counter()
    for module, stage in zip(runner.modules, runner.stage_ids):
        x = micro if stage == 0 else torch.zeros(micro.shape[0], micro.shape[1], runner_hidden(runner),
                                                  requires_grad=True)
        out = module(x)
        loss = next_token_loss(out, targets) if module.is_last else out.float().sum()
        loss.backward()
    return time.perf_counter() - start


def runner_hidden(runner: PipelineRunner) -> int:
    return runner.modules[0].blocks[next(iter(runner.modules[0].blocks))].attn_norm.weight.shape[0]


def _bench(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    ctx = build_parallel_context(ParallelDims(world_size, pp=P), "cpu")
    rows = {}
    for schedule in args.schedules:
        for m in args.microbatches:
            torch.manual_seed(0)
            model = MoETransformer(_config(args.hidden, args.seq))
            set_aux_loss_scale(model, 1.0)
            runner = PipelineRunner(model, ctx, schedule, m, next_token_loss, torch.device("cpu"))
            tokens = torch.randint(0, 256, (m * args.micro_batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            times, ideals = [], []
            for i in range(args.rounds + 1):
                model.zero_grad(set_to_none=True)
                torch.distributed.barrier()
                start = time.perf_counter()
                runner.step(inputs, targets)
                elapsed = time.perf_counter() - start
                model.zero_grad(set_to_none=True)
                ideal = m * _ideal(runner, inputs[: args.micro_batch], targets[: args.micro_batch])
                if i:  # the first round warms up (and builds the schedule)
                    times.append(elapsed)
                    ideals.append(ideal)
            rows[(schedule, m, runner.virtual_stages)] = (min(times), min(ideals))  # least disturbed by other load
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=list(PIPELINE_SCHEDULES), choices=list(PIPELINE_SCHEDULES))
    parser.add_argument("--microbatches", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--micro-batch", type=int, default=2, help="samples per micro-batch")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", help="also write the table to this markdown file")
    args = parser.parse_args()
    ranks = run_distributed(_bench, P, args, timeout_s=1800)
    lines = [
        f"Pipeline bubble, PP={P} gloo CPU ranks, hidden {args.hidden}, seq {args.seq}, {args.micro_batch} samples "
        "per micro-batch (bubble = 1 - ideal / step, worse rank)",
        "",
        "| case | step ms | ideal ms | bubble | theory | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for key in ranks[0]:
        schedule, m, v = key
        step = max(r[key][0] for r in ranks)
        bubble = max(1 - r[key][1] / r[key][0] for r in ranks)
        ideal = min(r[key][1] for r in ranks)
        expected = theory(schedule, m, v)
        lines.append(f"| {schedule} M={m} V={v} | {step * 1e3:.1f} | {ideal * 1e3:.1f} | {bubble:.3f} | "
                     f"{expected:.3f} | {bubble / expected:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
