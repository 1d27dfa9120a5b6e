"""End-to-end training throughput: the lightning-moe stack against Hugging Face Qwen3-MoE, on CPU.

Both sides train the same-shaped decoder-only MoE language model (the defaults: vocab 320, hidden
256, 2 layers, 4 heads, 8 experts top-2, expert ffn 256, sequence 128, batch 8 per process) on
the same random tokens with AdamW, through ``Trainer.fit``:

* ours: :class:`lightning_moe.lit.MoELanguageModel` (the reference :class:`~lightning_moe.models.MoETransformer`
  with qk-norm) under :class:`lightning_moe.strategies.MoEStrategy`;
* HF: ``transformers.Qwen3MoeForCausalLM`` built from a ``Qwen3MoeConfig`` of the same shape
  (random weights, ``experts_implementation="grouped_mm"``, ``attn_implementation="sdpa"``,
  ``norm_topk_prob=True``, no aux loss), in a plain LightningModule with the same loss, optimizer
  groups and schedule, trained with plain Lightning (single device, or ``DDPStrategy``).

Every run is a fresh process forked with ``tests/helpers/dist.py::run_distributed`` (a gloo group
of 1 or 2 ranks). Single-process runs use ``--threads`` threads; each of the 2 DDP ranks uses one.
Plain Lightning accepts the existing process group: ``DDPStrategy`` is given Lightning's own
``LightningEnvironment`` with ``LOCAL_RANK`` set (as a torchrun-style launcher would), so it
launches nothing and its ``_init_dist_connection`` finds the group initialised and returns.
``MoEStrategy`` detects the group by itself. Runs:

* ``ours-1`` / ``hf-1``: one process;
* ``ours-ddp2`` / ``hf-ddp2``: two processes, data parallel (``MoEStrategy()`` with every size 1:
  experts replicated, gradients bucketed and overlapped; ``DDPStrategy`` for HF);
* ``ours-ep2``: two processes, ``MoEStrategy(expert_parallel_size=2)`` (experts sharded,
  all-to-all dispatch), compared with ``hf-ddp2``.

Throughput is global tokens per second over ``--steps`` steps after ``--warmup`` steps:
``tokens/s`` from the median step time (a step = forward, backward and optimizer step, from
``on_train_batch_start`` to ``on_train_batch_end``, on the slowest rank), robust to load spikes on a
shared machine; ``tokens/s (wall)`` from the wall time of all timed steps (first batch start to
last batch end, so data loading and loop overhead included). Model FLOPs utilisation (MFU) is
the model's training FLOPs per second at ``tokens/s`` (6 x the matmul parameters a token uses +
12 x layers x seq x heads x head_dim for attention, the PaLM count, i.e. without halving for
causality) divided by the fp32 ``torch.mm`` rate measured in the same run (``[batch*seq, hidden]
@ [hidden, 2*ffn]``, best of ~0.3 s of repeats, before and after training, by every rank at the
same time, summed over ranks). Runs are interleaved; with ``--repeats R`` each run happens R
times and the medians are reported. The ``ours / HF`` column is the ``tokens/s`` ratio.

    python benchmarks/train_throughput.py                       # all five runs, defaults
    python benchmarks/train_throughput.py --steps 2 --warmup 1 --seq 32 --batch 2 --cases ours-1,hf-1
    python benchmarks/train_throughput.py --repeats 3 --output /tmp/train_throughput.md

The HF rows need ``transformers`` (the ``bench`` extra); without it they are listed as skipped.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))  # helpers

from helpers.dist import run_distributed

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.lit.optimization import optimizer_param_groups, warmup_cosine
from lightning_moe.models import MoETransformerConfig
from lightning_moe.strategies import MoEStrategy

CASES = {
    # name: (stack, processes, MoEStrategy kwargs)
    "ours-1": ("ours", 1, {}),
    "hf-1": ("hf", 1, None),
    "ours-ddp2": ("ours", 2, {}),
    "hf-ddp2": ("hf", 2, None),
    "ours-ep2": ("ours", 2, {"expert_parallel_size": 2}),
}
BASELINE = {"ours-1": "hf-1", "ours-ddp2": "hf-ddp2", "ours-ep2": "hf-ddp2"}
"""Which HF run each of ours is compared with (same number of processes)."""


@dataclass(frozen=True)
class Shape:
    """The model and batch shared by both stacks."""

    vocab: int = 320
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    experts: int = 8
    top_k: int = 2
    ffn: int = 256
    seq: int = 128
    batch: int = 8

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def ours(self) -> MoETransformerConfig:
        moe = MoEConfig(hidden_size=self.hidden, ffn_hidden_size=self.ffn, num_experts=self.experts, top_k=self.top_k)
        return MoETransformerConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, num_layers=self.layers, num_attention_heads=self.heads,
            head_dim=self.head_dim, max_seq_len=self.seq, qk_norm=True, moe=moe,
        )

    def hf(self):
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.heads, head_dim=self.head_dim,
            max_position_embeddings=self.seq, moe_intermediate_size=self.ffn, num_experts=self.experts,
            num_experts_per_tok=self.top_k, norm_topk_prob=True, output_router_logits=False,
            router_aux_loss_coef=0.0, tie_word_embeddings=False, use_cache=False,
            attn_implementation="sdpa", experts_implementation="grouped_mm",
        )

    def train_flops_per_token(self) -> float:
        """Training FLOPs per token: 3 x forward (6 x matmul parameters used + attention, PaLM count)."""
        q_width = self.heads * self.head_dim
        attention = 4 * q_width * self.hidden  # q, k, v, o (MHA)
        moe = self.experts * self.hidden + self.top_k * 3 * self.hidden * self.ffn  # router + top-k SwiGLU experts
        matmul_params = self.layers * (attention + moe) + self.vocab * self.hidden  # + lm_head
        attention_scores = self.layers * 4 * self.seq * q_width  # QK^T and AV, forward
        return 3 * (2 * matmul_params + attention_scores)


class HFQwen3MoeLM(L.LightningModule):
    """``Qwen3MoeForCausalLM`` trained like :class:`MoELanguageModel`: same loss, AdamW groups, schedule."""

    def __init__(self, shape: Shape, learning_rate: float = 3e-3, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 20, min_lr_ratio: float = 0.1) -> None:
        super().__init__()
        from transformers import Qwen3MoeForCausalLM

        config = shape.hf()
        self.model = Qwen3MoeForCausalLM(config)
        for name, expected in (("_experts_implementation", "grouped_mm"), ("_attn_implementation", "sdpa")):
            if getattr(self.model.config, name) != expected:
                raise RuntimeError(f"HF model built with {name}={getattr(self.model.config, name)!r}, not {expected!r}")
        self.hp = dict(learning_rate=learning_rate, weight_decay=weight_decay, betas=betas,
                       warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio)

    def training_step(self, batch, batch_idx: int):
        inputs, targets = batch
        logits = self.model(input_ids=inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        hp = self.hp
        optimizer = torch.optim.AdamW(optimizer_param_groups(self, hp["weight_decay"]), lr=hp["learning_rate"],
                                      betas=hp["betas"])
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, hp["warmup_steps"], total, hp["min_lr_ratio"])
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class StepTimer(Callback):
    """Wall-clock start and end of every training batch (forward, backward, optimizer step)."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.ends.append(time.perf_counter())


def gemm_rate(m: int, k: int, n: int, seconds: float = 0.3) -> float:
    """FLOP/s of an fp32 ``[m, k] @ [k, n]`` ``torch.mm``: the best of repeats over about ``seconds``
    (the attainable rate; on a shared machine the best is far steadier than the median)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(2):
        torch.mm(a, b)
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * m * k * n / min(times)


def _dataset(shape: Shape, samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, shape.vocab, (samples, shape.seq + 1), generator=gen)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def _train(rank: int, world_size: int, case: str, shape: Shape, steps: int, warmup: int, threads: int) -> dict:
    """One run on this rank: build, measure the GEMM rate, fit ``warmup + steps`` steps, measure again."""
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_moe"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if world_size == 1:
        torch.set_num_threads(threads)
    stack, _, strategy_kwargs = CASES[case]
    torch.manual_seed(0)
    if stack == "ours":
        module = MoELanguageModel(shape.ours())
        strategy = MoEStrategy(**strategy_kwargs)
    else:
        module = HFQwen3MoeLM(shape)
        if world_size == 1:
            strategy = "auto"
        else:
            from lightning.pytorch.plugins.environments import LightningEnvironment
            from lightning.pytorch.strategies import DDPStrategy

            os.environ["LOCAL_RANK"] = str(rank)  # LightningEnvironment: processes exist, this is local rank `rank`
            strategy = DDPStrategy(cluster_environment=LightningEnvironment(), process_group_backend="gloo")

    def measure() -> float:
        dist.barrier()  # every rank measures at the same time, as they train
        return gemm_rate(shape.batch * shape.seq, shape.hidden, 2 * shape.ffn)

    rate_before = measure()
    timer = StepTimer()
    total_steps = warmup + steps
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=total_steps, callbacks=[timer],
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    loader = DataLoader(_dataset(shape, total_steps * shape.batch * world_size), batch_size=shape.batch)
    trainer.fit(module, loader)
    rate_after = measure()
    if len(timer.ends) != total_steps:
        raise RuntimeError(f"{case}: ran {len(timer.ends)} steps, expected {total_steps}")
    params = sum(p.numel() for p in module.parameters())
    if stack == "ours" and strategy_kwargs.get("expert_parallel_size", 1) > 1:
        params = None  # expert shards: the local count is not the model's
    return {
        "elapsed": timer.ends[-1] - timer.starts[warmup],
        "step_times": [e - s for s, e in zip(timer.starts[warmup:], timer.ends[warmup:])],
        "gemm_rate": max(rate_before, rate_after),
        "loss": float(trainer.callback_metrics["train_loss"]),
        "params": params,
        "strategy": type(trainer.strategy).__name__,
    }


def run_case(case: str, shape: Shape, steps: int, warmup: int, threads: int) -> dict:
    """Fork the ranks of ``case`` and combine their results (slowest rank's time, summed GEMM rates)."""
    _, processes, _ = CASES[case]
    with tempfile.TemporaryDirectory(prefix="train_throughput-") as tmp:
        ranks = run_distributed(_train, processes, case, shape, steps, warmup, threads, timeout_s=900, tmp_dir=tmp)
    tokens_per_step = shape.batch * shape.seq * processes
    step_s = statistics.median(max(ts) for ts in zip(*(r["step_times"] for r in ranks)))  # slowest rank
    tokens_per_s = tokens_per_step / step_s
    wall_tokens_per_s = steps * tokens_per_step / max(r["elapsed"] for r in ranks)
    gemm = sum(r["gemm_rate"] for r in ranks)
    return {
        "tokens_per_s": tokens_per_s, "wall_tokens_per_s": wall_tokens_per_s, "step_ms": step_s * 1e3,
        "gemm_rate": gemm,
        "mfu": tokens_per_s * shape.train_flops_per_token() / gemm, "loss": ranks[0]["loss"],
        "params": ranks[0]["params"], "strategy": ranks[0]["strategy"], "processes": processes,
    }


def _describe(case: str, strategy: str, threads: int) -> str:
    stack, processes, kwargs = CASES[case]
    threads_note = f"{threads} thread{'s' if threads > 1 else ''}" if processes == 1 else "1 thread per rank"
    if stack == "ours":
        sizes = ", ".join(f"{k}={v}" for k, v in kwargs.items()) or "all sizes 1"
        layout = "one process" if processes == 1 else ("data parallel" if not kwargs else "experts sharded")
        return f"MoELanguageModel + MoEStrategy({sizes}): {layout}; {threads_note}"
    return f"Qwen3MoeForCausalLM (grouped_mm experts, sdpa) + plain Lightning {strategy}; {threads_note}"


def table(results: dict[str, list[dict]], shape: Shape, args) -> str:
    lines = [
        f"### Training throughput: vocab {shape.vocab}, hidden {shape.hidden}, {shape.layers} layers, "
        f"{shape.heads} heads, {shape.experts} experts top-{shape.top_k}, ffn {shape.ffn}, seq {shape.seq}, "
        f"batch {shape.batch} per process ({args.steps} timed steps after {args.warmup}; "
        f"{args.repeats} repeat(s), median; {shape.train_flops_per_token() / 1e6:.2f} MFLOP per token)",
        "",
        "| run | processes | tokens/s | tokens/s (wall) | step ms (median) | GEMM GFLOP/s (measured) | MFU "
        "| ours / HF | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def median_of(case: str, key: str) -> float:
        return statistics.median(r[key] for r in results[case])

    for case, runs in results.items():
        tps = median_of(case, "tokens_per_s")
        base = BASELINE.get(case)
        ratio = f"{tps / median_of(base, 'tokens_per_s'):.2f}x vs {base}" if base in results else "–"
        params = runs[0]["params"]
        notes = _describe(case, runs[0]["strategy"], args.threads) + (f"; {params / 1e6:.2f} M params" if params else "")
        lines.append(
            f"| {case} | {runs[0]['processes']} | {tps:,.0f} | {median_of(case, 'wall_tokens_per_s'):,.0f} | "
            f"{median_of(case, 'step_ms'):.1f} | "
            f"{median_of(case, 'gemm_rate') / 1e9:.1f} | {median_of(case, 'mfu') * 100:.1f}% | {ratio} | {notes} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Shape()
    for field, value in asdict(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every case (interleaved), median reported")
    parser.add_argument("--cases", default="all", help=f"'all' or comma-separated: {', '.join(CASES)}")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of single-process runs")
    parser.add_argument("--output", default="", help="also write the table to this markdown file")
    args = parser.parse_args(argv)

    shape = Shape(**{field: getattr(args, field) for field in asdict(defaults)})
    cases = list(CASES) if args.cases == "all" else args.cases.split(",")
    for case in cases:
        if case not in CASES:
            parser.error(f"unknown case {case!r}; choose from {', '.join(CASES)}")
    skipped = {}
    try:
        from transformers import Qwen3MoeForCausalLM  # noqa: F401
    except Exception as err:
        reason = f"transformers is not installed ({type(err).__name__}: {err}); pip install -e '.[bench]'"
        skipped = {c: reason for c in cases if CASES[c][0] == "hf"}
        cases = [c for c in cases if c not in skipped]

    header = (
        f"Command: `python benchmarks/train_throughput.py {' '.join(argv if argv is not None else sys.argv[1:])}`  \n"
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"lightning {L.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    results: dict[str, list[dict]] = {case: [] for case in cases}
    for _ in range(args.repeats):
        for case in cases:
            result = run_case(case, shape, args.steps, args.warmup, args.threads)
            results[case].append(result)
            print(f"  {case}: {result['tokens_per_s']:,.0f} tokens/s, loss {result['loss']:.3f}", flush=True)
    text = header + "\n\n" + table(results, shape, args)
    if skipped:
        text += "\n\nSkipped: " + "; ".join(f"{k} ({v})" for k, v in skipped.items())
    print("\n" + text, flush=True)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
