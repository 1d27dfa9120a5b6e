"""Saved-activation bytes per token per MoE layer with selective recompute and activation offload.

Counted with saved-tensor hooks (``lightning_moe.memory.SavedTensorCounter``): unique storages
autograd keeps for backward after one forward of a small reference ``MoETransformer`` (fp32, CPU),
parameters excluded, attributed to the module that saved them first; only storages still alive
count, so offloaded ones (whose device copy was released) drop out. Exact and machine independent.
Every configuration is also checked to give the same loss and gradients as ``none``.

    python benchmarks/memory.py                       # the table, well under a minute
    python benchmarks/memory.py --output memory.md    # also as markdown
    python benchmarks/memory.py --rss                 # plus peak RSS of a training step per config

Predictions come from the design (``megatron-core-moe.md`` 4.2/4.3): ``moe_act`` recompute drops
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
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

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
                      top_k=sizes.top_k, shared_expert_ffn_hidden_size=sizes.shared_ffn,
                      aux_loss_coeff=1e-2, z_loss_coeff=1e-3),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="", help="also write the table to this markdown file")
    parser.add_argument("--rss", action="store_true", help="peak RSS growth of a step per config (subprocesses)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    set_cpu_gemm_backend("aten")  # unpadded expert rows: machine-independent counts (module docstring)
    sizes = Sizes()
    base = build(sizes)
    batch = torch.randint(0, sizes.vocab, (sizes.batch, sizes.seq + 1), generator=torch.Generator().manual_seed(1))

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
