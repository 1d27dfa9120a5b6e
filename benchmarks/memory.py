"""Saved-activation bytes per token per MoE layer with selective recompute and activation offload.

Counted with saved-tensor hooks (``lightning_moe.memory.SavedTensorCounter``): unique storages
autograd keeps for backward after one forward of a small reference ``MoETransformer`` (fp32, CPU),
parameters excluded, attributed to the module that saved them first; only storages still alive
count, so offloaded ones (whose device copy was released) drop out. Exact and machine independent.
Every configuration is also checked to give the same loss and gradients as ``none``.

    python benchmarks/memory.py                       # the table, well under a minute
    python benchmarks/memory.py --output memory.md    # also as markdown
    python benchmarks/memory.py --rss                 # plus peak RSS of a training step per config
    python benchmarks/memory.py --grad-sync           # gradient bytes of a backward + reduction step
    python benchmarks/memory.py --sharding            # per-rank state bytes per sharding strategy (sharding_memory.py)

Predictions come from the design (docs/numerics.md §13): ``moe_act`` recompute drops
the activation output, ``N x F x 4`` bytes per layer (``K x F x 4`` per token, ``N = T x K``); the
offload of a boundary moves its saved storages in every layer but the last (kept by the warm-up
rule), ``(L-1)/L`` of them per layer on average. Where the design rule needs a size only the run
knows (what a norm or the router saves internally), the prediction uses the ``none`` row's count
of that module and says so. On CPU the offload target is host memory too: "moved" are the bytes
that would go to pinned host memory on a GPU.

The expert kernel's GEMMs run through ``torch.mm`` here (``set_cpu_gemm_backend("aten")``), so
the counts do not depend on the CPU: where the kernel picks oneDNN instead, it pads each expert's
rows (``lightning_moe.layers.cpu_gemm.padded_row_count``, at most 1/8 more, 16 rows minimum) and
its saved fc1 output and activation grow by that padding.

``--grad-sync`` measures instead the gradient bytes at the peak of one backward + reduction step
(after a warm-up step, ``zero_grad(set_to_none=True)`` as Lightning does) of the same model under
`GradSync` (persistent bucket buffers, ``param.grad`` a view) and under the scheme it replaced
(each bucket concatenated into a fresh flat tensor at launch, alive until ``finish``, then copied
back; reimplemented here as `ConcatenatingGradSync`). Counted exactly: the distinct storages of
every ``param.grad`` and of the reducer's buffers, sampled before and after every gradient hook
and around ``finish`` (a one-rank gloo group: what is measured is one rank's memory, not the wire).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_moe import MoEConfig
from lightning_moe.layers.cpu_gemm import set_cpu_gemm_backend
from lightning_moe.layers.experts import GroupedExperts
from lightning_moe.memory import (
    OFFLOAD_MODULES,
    RECOMPUTE_MODULES,
    SavedTensorCounter,
    apply_activation_offload,
    apply_selective_recompute,
)
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims, build_parallel_context
from lightning_moe.parallel.grad_sync import GradSync

FP32 = 4
COMBINATION = (("moe_act", "layernorm"), ("expert_fc1", "moe_act", "core_attn", "attn_proj"))
"""Recompute and offload modules of the combined row: complementary choices (offloading the
norm outputs as well, ``qkv_linear``/``*_norm``, would move what ``layernorm`` already drops)."""


@dataclass(frozen=True)
class Sizes:
    batch: int = 4
    seq: int = 64
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 64
    shared_ffn: int = 64
    experts: int = 8
    top_k: int = 2
    layers: int = 4
    vocab: int = 256

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k


def build(sizes: Sizes) -> MoETransformer:
    torch.manual_seed(0)
    model = MoETransformer(MoETransformerConfig(
        vocab_size=sizes.vocab, hidden_size=sizes.hidden, num_layers=sizes.layers,
        num_attention_heads=sizes.heads, num_kv_heads=sizes.kv_heads, ffn_hidden_size=4 * sizes.hidden,
        max_seq_len=sizes.seq, qk_norm=True,
        moe=MoEConfig(hidden_size=sizes.hidden, ffn_hidden_size=sizes.ffn, num_experts=sizes.experts,
                      top_k=sizes.top_k, shared_expert_ffn_hidden_size=sizes.shared_ffn, z_loss_coeff=1e-3),
    ))
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.recompute_activation = False  # baseline keeps the activation (CPU default recomputes)
    return model


REGIONS = ("attn_norm", "attn", "core_attn", "ffn_norm", "router", "shared_expert", "experts", "moe_rest")


def region_modules(model: MoETransformer) -> dict[str, torch.nn.Module]:
    tracked = {}
    for i, block in enumerate(model.layers):
        tracked.update({
            f"{i}.attn_norm": block.attn_norm, f"{i}.attn": block.attn, f"{i}.core_attn": block.attn.core_attn,
            f"{i}.ffn_norm": block.ffn_norm, f"{i}.moe_rest": block.ffn, f"{i}.router": block.ffn.router,
            f"{i}.shared_expert": block.ffn.shared_expert, f"{i}.experts": block.ffn.experts,
        })
    return tracked


def apply(model: MoETransformer, recompute: tuple[str, ...], offload: tuple[str, ...]):
    if recompute:
        apply_selective_recompute(model, list(recompute))
    return apply_activation_offload(model, list(offload), min_tensor_bytes=0).offloader if offload else None


def measure(base: MoETransformer, batch: torch.Tensor, recompute=(), offload=()) -> dict:
    """One training step: per-region saved bytes after the forward, bytes offloaded, loss and grads."""
    model = copy.deepcopy(base)
    offloader = apply(model, recompute, offload)
    counter = SavedTensorCounter(exclude=model)
    handles = counter.track(region_modules(model))
    with counter:
        loss = model.loss(batch[:, :-1], batch[:, 1:])
    saved = counter.saved_bytes()
    loss.backward()
    for handle in handles:
        handle.remove()
    per_region = {name: sum(v for k, v in saved.items() if k.split(".", 1)[-1] == name) for name in REGIONS}
    return {
        "regions": per_region,
        "other": saved.get("other", 0),
        "moved": offloader.stats.offloaded_bytes if offloader else 0,
        "loss": loss.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
    }


def rss_of_step(sizes: Sizes, recompute, offload) -> int:
    """Peak-RSS growth (KiB) of one training step in a fresh interpreter (allocator noise included)."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import json,resource,sys,torch; sys.path.insert(0, {here!r}); import memory as m\n"
        "m.set_cpu_gemm_backend('aten')\n"
        f"s = m.Sizes(**json.loads({json.dumps(sizes.__dict__)!r})); model = m.build(s)\n"
        f"m.apply(model, {tuple(recompute)!r}, {tuple(offload)!r})\n"
        "batch = torch.randint(0, s.vocab, (s.batch, s.seq + 1), generator=torch.Generator().manual_seed(1))\n"
        "model.loss(batch[:, :-1], batch[:, 1:]).backward(); model.zero_grad(set_to_none=True)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "model.loss(batch[:, :-1], batch[:, 1:]).backward()\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return int(result.stdout.strip().splitlines()[-1])


def predictions(sizes: Sizes, none: dict) -> dict[str, tuple[str, float, float]]:
    """Design predictions per row, bytes per token per layer: (formula, Δ saved, moved to host)."""
    s, r = sizes, none["regions"]
    per = 1 / (s.tokens * s.layers)  # measured region bytes (all layers) -> per token per layer
    keep = (s.layers - 1) / s.layers  # the warm-up rule keeps the last layer's group on the device
    head_dim = s.hidden // s.heads
    tables = 2 * s.seq * head_dim * FP32 / (s.tokens * s.layers)  # rotary cos/sin, shared by all layers
    norms, attn = (r["attn_norm"] + r["ffn_norm"]) * per, (r["attn"] + r["core_attn"]) * per
    moe = (r["router"] + r["shared_expert"] + r["experts"] + r["moe_rest"]) * per
    attn_out = s.heads * head_dim * FP32  # core attention's output = o_proj's input (one storage)

    def moved(formula: str, nbytes: float, shared: float = 0.0) -> tuple[str, float, float]:
        return formula, -(keep * nbytes - keep * shared), keep * nbytes

    return {
        "moe_act": ("Δ = -K·F·4: the N×F activation output", -s.top_k * s.ffn * FP32, 0.0),
        "layernorm": ("norms keep only their input; outputs (2·H·4) not kept downstream: Δ = -norms[none]",
                      -norms, 0.0),
        "shared_experts": ("Δ = -4·Fs·4: fc1 out 2Fs, silu Fs, act Fs (input kept by router)",
                           -4 * s.shared_ffn * FP32, 0.0),
        "router": ("Δ = -router[none] (its input stays saved by the experts)", -r["router"] * per, 0.0),
        "core_attn": ("Δ = -heads·4: logsumexp (q, k, v held; output is o_proj's input)", -s.heads * FP32, 0.0),
        "attention": ("Δ = -attn[none] + H·4 + cos/sin (inputs held)", -attn + s.hidden * FP32 + tables, 0.0),
        "moe": ("Δ = -moe[none] + H·4 (input held)", -moe + s.hidden * FP32, 0.0),
        "offload:attn_norm": moved("moved (L-1)/L·attn_norm[none]", r["attn_norm"] * per),
        "offload:qkv_linear": moved("moved (L-1)/L·H·4", s.hidden * FP32),
        "offload:core_attn": moved("moved (L-1)/L·core_attn[none]; output shared with o_proj",
                                   r["core_attn"] * per, attn_out),
        "offload:attn_proj": moved("moved (L-1)/L·heads·D·4; same storage saved by core_attn: Δ 0",
                                   attn_out, attn_out),
        "offload:mlp_norm": moved("moved (L-1)/L·ffn_norm[none]", r["ffn_norm"] * per),
        "offload:expert_fc1": moved("moved (L-1)/L·H·4; layer input also saved by router, shared expert: Δ 0",
                                    s.hidden * FP32, s.hidden * FP32),
        "offload:moe_act": moved("moved (L-1)/L·K·3F·4: fc1 out 2F, act out F", s.top_k * 3 * s.ffn * FP32),
    }


def same_run(row: dict, none: dict) -> bool:
    if not torch.allclose(row["loss"], none["loss"], rtol=1e-5, atol=1e-6):
        return False
    return all(torch.allclose(row["grads"][n], g, rtol=1e-4, atol=1e-6) for n, g in none["grads"].items())


# ---------------------------------------------------------------------------------------------
# --grad-sync: gradient bytes of a backward + reduction step

GRAD_SYNC_BUCKET_MB = 0.5
"""Bucket cap of the --grad-sync runs: several buckets for this small model."""


class ConcatenatingGradSync:
    """The reduction `GradSync` replaced, for the "before" rows: same buckets, launch order and hooks.

    At launch each bucket is concatenated into a fresh flat tensor (gradients, zeros for missing
    ones, then one flag per parameter sent from a host list); the flats live until `finish`,
    which waits and copies the reduced values back into ``param.grad``. Plain parameters only.
    """

    def __init__(self, module: torch.nn.Module, ctx, bucket_size_mb: float) -> None:
        layout = GradSync(module, ctx, bucket_size_mb)  # only for its bucket layout
        layout.remove_hooks()
        self.ctx, self.scale = ctx, layout.scale
        self.buckets = [(b.params, b.group_name) for b in layout.buckets]
        self.flats: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._handles: list[object | None] = [None] * len(self.buckets)
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._where = {id(p): (i, j) for i, (params, _) in enumerate(self.buckets) for j, p in enumerate(params)}
        self._next, self._pending, self._sync_enabled = 0, False, True
        for params, _ in self.buckets:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate without launching, as `GradSync.no_sync`."""
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._pending = True
        if not self._sync_enabled:
            return
        i, j = self._where[id(param)]
        self._ready[i].add(j)
        while self._next < len(self.buckets) and len(self._ready[self._next]) == len(self.buckets[self._next][0]):
            self._launch(self._next)
            self._next += 1

    @torch.no_grad()
    def _launch(self, i: int) -> None:
        params, group = self.buckets[i]
        pieces = [torch.zeros(p.numel(), dtype=p.dtype) if p.grad is None else p.grad.reshape(-1) for p in params]
        flags = torch.tensor([p.grad is not None for p in params], dtype=params[0].dtype)
        flat = self.flats[i] = torch.cat([*pieces, flags])
        flat[: flat.numel() - len(params)].mul_(self.scale)
        if self.ctx.size(group) > 1:
            self._handles[i] = dist.all_reduce(flat, group=self.ctx.group(group), async_op=True)

    @torch.no_grad()
    def finish(self) -> None:
        """Launch the rest, wait, copy the reduced gradients back."""
        if not self._pending:
            return
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        for i, (params, _) in enumerate(self.buckets):
            if self._handles[i] is not None:
                self._handles[i].wait()
            flat, offset = self.flats[i], 0
            had = flat[flat.numel() - len(params) :].tolist()
            for p, flag in zip(params, had):
                reduced = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if flag and p.grad is None:
                    p.grad = reduced.clone()
                elif flag:
                    p.grad.copy_(reduced)
            self.flats[i] = self._handles[i] = None
            self._ready[i].clear()
        self._next, self._pending = 0, False

    def buffers(self) -> list[torch.Tensor]:
        """The flats alive now."""
        return [f for f in self.flats if f is not None]


def _sync_buffers(sync) -> list[torch.Tensor]:
    if isinstance(sync, ConcatenatingGradSync):
        return sync.buffers()
    return [b.buffer for b in sync.buckets if b.buffer is not None]


def _bucket_bytes(sync) -> list[int]:
    buckets = [params for params, _ in sync.buckets] if isinstance(sync, ConcatenatingGradSync) else [
        b.params for b in sync.buckets]
    return [sum(p.numel() * p.element_size() for p in params) for params in buckets]


class GradientBytes:
    """Peak bytes of the distinct storages behind every ``param.grad`` and the reducer's buffers."""

    def __init__(self, params: list[torch.nn.Parameter], buffers: Callable[[], list[torch.Tensor]]) -> None:
        self.params, self.buffers, self.peak = params, buffers, 0

    def sample(self, *_: object) -> None:
        """Count now; usable as a post-accumulate-grad hook."""
        storages = {}
        for tensor in [p.grad for p in self.params if p.grad is not None] + self.buffers():
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        self.peak = max(self.peak, sum(storages.values()))


def grad_sync_step(base: MoETransformer, batch: torch.Tensor, ctx, reducer: type, micro_batches: int) -> dict:
    """Peak gradient bytes of the second of two steps, and the reduced gradients."""
    model = copy.deepcopy(base)
    params = [p for p in model.parameters() if p.requires_grad]
    sync = None
    probe = GradientBytes(params, lambda: _sync_buffers(sync))
    # Hooks run in registration order: these see each gradient before and after the reducer's hook.
    hooks = [p.register_post_accumulate_grad_hook(probe.sample) for p in params]
    sync = reducer(model, ctx, GRAD_SYNC_BUCKET_MB)
    hooks += [p.register_post_accumulate_grad_hook(probe.sample) for p in params]
    micro = batch.chunk(micro_batches)
    for _ in range(2):  # the first step allocates GradSync's buffers; the second is measured
        model.zero_grad(set_to_none=True)
        probe.peak = 0
        for i, part in enumerate(micro):
            with sync.no_sync() if i < micro_batches - 1 else nullcontext():
                (model.loss(part[:, :-1], part[:, 1:]) / micro_batches).backward()
        probe.sample()
        sync.finish()
        probe.sample()
    for hook in hooks:
        hook.remove()
    buckets = _bucket_bytes(sync)
    return {
        "peak": probe.peak,
        "one_copy": sum(p.numel() * p.element_size() for p in params),
        "flags": len(params) * params[0].element_size(),
        "largest_bucket": max(buckets),
        "largest_param": max(p.numel() * p.element_size() for p in params),
        "buckets": len(buckets),
        "grads": [p.grad.clone() for p in params],
    }


def grad_sync_table(base: MoETransformer, batch: torch.Tensor) -> tuple[str, str]:
    """(intro, markdown table) of --grad-sync."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ctx = build_parallel_context(ParallelDims(1), "cpu")
        header = ["reducer", "micro-batches", "peak gradient bytes", "one copy of the gradients", "peak / one copy",
                  "peak - one copy - flags", "bound: one copy + flags + largest bucket", "within bound",
                  "same grads as before"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for micro_batches in (1, 2):
            before = grad_sync_step(base, batch, ctx, ConcatenatingGradSync, micro_batches)
            after = grad_sync_step(base, batch, ctx, GradSync, micro_batches)
            for name, row in (("concatenated flat per bucket (before)", before),
                              ("GradSync: persistent bucket buffers", after)):
                bound = row["one_copy"] + row["flags"] + row["largest_bucket"]
                same = all(torch.equal(a, b) for a, b in zip(row["grads"], before["grads"]))
                lines.append("| " + " | ".join([
                    name, str(micro_batches), str(row["peak"]), str(row["one_copy"]),
                    f"{row['peak'] / row['one_copy']:.3f}", str(row["peak"] - row["one_copy"] - row["flags"]),
                    str(bound), "yes" if row["peak"] <= bound else "NO",
                    "yes" if same else "NO",
                ]) + " |")
    finally:
        dist.destroy_process_group()
    intro = (
        f"Same MoETransformer (fp32, {sum(p.numel() for p in base.parameters())} parameters, "
        f"{len(list(base.parameters()))} tensors), one rank, buckets of at most {GRAD_SYNC_BUCKET_MB} MiB "
        f"({before['buckets']} buckets, largest {before['largest_bucket']} B; largest parameter "
        f"{before['largest_param']} B). Peak = largest sum of distinct gradient storages (every param.grad and "
        f"the reducer's buffers) over the samples of the second step; flags: one element per parameter "
        f"({before['flags']} B). GradSync's excess over one copy is autograd's fresh gradient of one "
        "parameter before its hook copies it into the bucket (the first micro-batch after zero_grad).\n"
    )
    return intro, "\n".join(lines)


def _report(title: str, flag: str, intro: str, table: str, output: str) -> None:
    """Print ``table``; with ``output``, also write it there as markdown under ``title`` and ``intro``."""
    print(table)
    if output:
        with open(output, "w", encoding="utf-8") as f:
            f.write(f"# {title}\n\n`python benchmarks/memory.py {flag}` (torch {torch.__version__})\n\n{intro}\n{table}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="", help="also write the table to this markdown file")
    parser.add_argument("--rss", action="store_true", help="peak RSS growth of a step per config (subprocesses)")
    parser.add_argument("--grad-sync", action="store_true",
                        help="gradient bytes of a backward + reduction step instead (module docstring)")
    parser.add_argument("--sharding", action="store_true",
                        help="per-rank bytes of parameters, gradients and AdamW state per sharding strategy instead")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.sharding:
        from sharding_memory import __doc__ as sharding_doc
        from sharding_memory import sharding_table

        _report("Sharded data parallelism: per-rank bytes", "--sharding", sharding_doc, sharding_table(), args.output)
        return
    torch.set_num_threads(args.threads)
    set_cpu_gemm_backend("aten")  # unpadded expert rows: machine-independent counts (module docstring)
    sizes = Sizes()
    base = build(sizes)
    batch = torch.randint(0, sizes.vocab, (sizes.batch, sizes.seq + 1), generator=torch.Generator().manual_seed(1))
    if args.grad_sync:
        intro, table = grad_sync_table(base, batch)
        print(intro)
        _report("Gradient-sync memory", "--grad-sync", intro, table, args.output)
        return

    configs = [("none", (), ())]
    configs += [(f"recompute {m}", (m,), ()) for m in RECOMPUTE_MODULES]
    configs += [(f"offload {m}", (), (m,)) for m in OFFLOAD_MODULES]
    configs += [("recompute " + "+".join(COMBINATION[0]) + ", offload " + "+".join(COMBINATION[1]), *COMBINATION)]

    rows = {name: measure(base, batch, rc, off) for name, rc, off in configs}
    none = rows["none"]
    predicted = predictions(sizes, none)
    per = 1 / (sizes.tokens * sizes.layers)

    def layer_bytes(row):
        return sum(row["regions"].values()) * per

    header = ["config", "saved B/token/layer", "Δ vs none", "predicted Δ", "experts part", "moved to host",
              "predicted moved", "design rule", "same grads"]
    if args.rss:
        header.append("peak RSS step (KiB)")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, recompute, offload in configs:
        row = rows[name]
        if len(recompute) + len(offload) == 1:
            formula, delta, move = predicted[recompute[0] if recompute else f"offload:{offload[0]}"]
            cells = [f"{delta + 0.0:+.1f}", f"{move:.1f}", formula]
        elif recompute and offload:
            formula, delta, _ = predicted["moe_act"]
            cells = ["", "", f"experts part {delta:+.0f} from moe_act; the offloads as in their rows"]
        else:
            cells = ["", "", ""]
        cells = [
            name, f"{layer_bytes(row):.1f}", f"{layer_bytes(row) - layer_bytes(none):+.1f}", cells[0],
            f"{row['regions']['experts'] * per:.1f}", f"{row['moved'] * per:.1f}", cells[1], cells[2],
            "yes" if same_run(row, none) else "NO",
        ]
        if args.rss:
            cells.append(str(rss_of_step(sizes, recompute, offload)))
        lines.append("| " + " | ".join(cells) + " |")

    s = sizes
    intro = (
        f"MoETransformer fp32 CPU: L={s.layers} MoE layers, T={s.tokens} tokens (B={s.batch} x S={s.seq}), "
        f"H={s.hidden}, heads={s.heads} (D={s.hidden // s.heads}, kv={s.kv_heads}), E={s.experts}, K={s.top_k}, "
        f"F={s.ffn} per expert (swiglu: fc1 2F), shared Fs={s.shared_ffn}; N = T·K = {s.rows} expert rows.\n"
        f"Bytes per token per MoE layer = saved storages of the {s.layers} transformer layers / (T·L); "
        f"outside the layers (embedding, head, loss): {none['other'] / s.tokens:.1f} B/token. "
        f"Offload with min_tensor_bytes=0; moved = bytes copied to the offload target in one step / (T·L).\n"
        f"moe_act recompute: N x F x 4 = {s.rows} x {s.ffn} x 4 = {s.rows * s.ffn * FP32} bytes per layer "
        f"= {s.top_k * s.ffn * FP32} per token.\n"
    )
    table = "\n".join(lines)
    print(intro)
    print(table)
    if args.output:
        command = "python benchmarks/memory.py" + (" --rss" if args.rss else "")
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(f"# Saved-activation memory\n\n`{command}` (torch {torch.__version__})\n\n{intro}\n{table}\n")


if __name__ == "__main__":
    main()
