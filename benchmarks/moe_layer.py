"""Forward+backward time of `MoELayer` against the GEMM floor and the peers, in one process.

The floor is the work no MoE layer can avoid: the nine expert GEMMs of forward and backward
(gate, up and down projections; their input and weight gradients) on perfectly balanced shapes
(``N / E`` rows per expert, ``N = tokens * top_k``), without routing or activation. It is measured
twice: as nine ``F.grouped_mm`` calls (the reference floor; every ratio is against it) and as the
same GEMMs with ``torch.bmm`` on ``[E, N/E, *]`` tensors. Every row is a ratio to the grouped_mm
floor of the same dtype, measured in the same run with the cases interleaved (machines are noisy).

Rows of a suite:

* floors: ``grouped_mm`` (the reference) and ``bmm``; in bf16 on CPU also the grouped_mm floor
  with bf16 operands computed in fp32 (what our CPU expert kernel does with bf16 experts); where
  the expert kernel runs its fp32 GEMMs through oneDNN (``lightning_moe.layers.cpu_gemm``: on CPUs
  where oneDNN clearly beats the BLAS behind ``torch.mm``), also the nine GEMMs through oneDNN,
  the floor of that library;
* ``lightning_moe MoELayer`` (the device's default kernel; on CPU in fp32 also ``kernel=grouped_mm``,
  and where it uses oneDNN also the layer with new routing every step, whose changing expert row
  counts are new GEMM shapes for oneDNN, and the layer with its GEMMs through ``torch.mm``);
* LoRA: the layer with one rank-16 adapter per expert on fc1 and fc2
  (:class:`~lightning_moe.lora.LoRAGroupedExperts`) and the same layer without adapters, both
  with frozen expert weights and ``grouped_mm`` GEMMs, as a LoRA fine-tune runs; the line under
  the table gives their ratio (what the adapters cost);
* ``overhead: lightning_moe router + permutation``: the same layer with identity experts (see
  :class:`IdentityExperts`): router, expert-major ordering of the (token, expert) pairs, the
  gather of the routed rows, the probability scaling and the scatter-add back to the tokens,
  forward and backward, i.e. everything of the layer except the expert MLPs;
* peers from ``benchmarks/peers.py`` (Hugging Face Qwen3-MoE and Mixtral sparse blocks,
  Megatron Core ``MoELayer``, plus DeepSpeed and torchtitan where installed), each note states
  its routing; the ``*_routing_overhead`` peers are the same identity-expert measurement.

All layers route for real (softmax top-k with the suite's config, renormalised top-k
probabilities, no aux loss, weights N(0, 0.02)); only the floors are balanced by construction.

    python benchmarks/moe_layer.py                 # S fp32+bf16 and M fp32, every peer installed (CPU)
    python benchmarks/moe_layer.py --configs S --rounds 1 --peers none --dtypes fp32   # smoke run
    python benchmarks/moe_layer.py --configs S --dtypes fp32 --peers hf_qwen3_grouped_mm,megatron_core
    python benchmarks/moe_layer.py --device cuda   # config L in bf16 (GPU sizes; benchmarks/gpu_check.sh)
    PYTHONPATH=/tmp/peers_ds:/tmp/peers_titan python benchmarks/moe_layer.py   # + DeepSpeed, torchtitan

Peers need the ``bench`` extra (``pip install -e ".[bench]"``); DeepSpeed and torchtitan are
installed separately (see ``benchmarks/peers.py``); missing ones are listed as skipped. On CPU,
bf16 GEMMs are ~28x slower than fp32 on AVX2 machines without bf16 instructions (and faster than
fp32 on CPUs with avx512_bf16 or AMX), so bf16 runs at S only by default; where bf16 GEMMs are
slow, torchtitan (which casts its experts to bf16) is skipped at M unless ``--include-slow``
(about two minutes per step on an AVX2 machine).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import Case, ratio_table, run_interleaved, write_tables

from lightning_moe import MoEConfig
from lightning_moe.layers.cpu_gemm import OneDnnGemm, gemm_for, use_cpu_gemm_backend
from lightning_moe.layers.moe import MoELayer
from lightning_moe.lora import LoRAGroupedExperts


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
    def rows(self) -> int:
        """Routed rows N = tokens * top_k."""
        return self.tokens * self.top_k

    @property
    def gemm_flops(self) -> float:
        """FLOPs of the nine expert GEMMs (forward + backward)."""
        return 9 * 2 * self.rows * self.hidden * self.ffn


SHAPES = {
    "S": Shape("S", 2048, 512, 256, 32, 4),
    "M": Shape("M", 4096, 1024, 512, 64, 8),
    "L": Shape("L", 16384, 2048, 1408, 64, 6),  # GPU sizes (Qwen2-MoE / DeepSeek-V2-Lite-like)
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_CONFIGS = {"cpu": "S,M", "cuda": "L"}
DEFAULT_DTYPES = {"S": "fp32,bf16", "M": "fp32", "L": "bf16"}
"""Dtypes per config when ``--dtypes`` is not given (CPU bf16 GEMMs are slow: S only)."""
SLOW_ON_CPU = {"torchtitan": "S"}
"""Peers that compute in bf16 whatever the dtype: skipped beyond the given config on CPUs whose
bf16 GEMMs are slow (see :func:`bf16_gemms_are_slow`), unless ``--include-slow``."""
FLOOR_ROUTING = "routing: none, balanced N/E rows per expert"
NEW_ROUTING_INPUTS = 16
LORA_RANK = 16
"""Rank of the LoRA adapters on every expert's fc1 and fc2 in the LoRA row."""
LORA_NAME = f"lightning_moe MoELayer + LoRA r={LORA_RANK} [grouped_mm, experts frozen]"
LORA_BASELINE_NAME = "lightning_moe MoELayer [kernel=grouped_mm, experts frozen]"
"""Inputs the ``new routing every step`` row cycles through."""


def default_rounds(shape: Shape, dtype_name: str, device: torch.device) -> int:
    """Timed rounds per suite: enough for a median, few enough for a few minutes on 2 CPU cores."""
    if device.type == "cuda":
        return 10
    if dtype_name == "bf16":
        return 2
    return 7 if shape.name == "S" else 3


def bf16_gemms_are_slow(size: int = 512) -> bool:
    """Whether a bf16 ``torch.mm`` is over 3x slower than fp32 here (CPUs without avx512_bf16 / AMX)."""

    def best(dtype: torch.dtype) -> float:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        times = []
        for _ in range(4):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        return min(times[1:])

    return best(torch.bfloat16) > 3 * best(torch.float32)


def _synced(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``step`` followed by a device synchronisation, so wall time covers the queued kernels."""
    if device.type != "cuda":
        return step

    def run() -> None:
        step()
        torch.cuda.synchronize(device)

    return run


def _floor_tensors(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
    """Balanced operands: tokens ``x`` and output gradient ``dy`` ``[N, H]``, an ``[N, F]`` activation
    (gradient) ``dh``, weights in ``nn.Linear``'s ``[E, out, in]`` layout: ``w_gate``/``w_up``
    ``[E, F, H]``, ``w_down`` ``[E, H, F]`` (as `GroupedExperts` and the HF experts store them)."""
    if shape.rows % shape.experts:
        raise ValueError(f"config {shape.name}: tokens*top_k={shape.rows} is not a multiple of {shape.experts} experts")
    gen = torch.Generator(device=device).manual_seed(0)  # drawn on the device: the L operands are large

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device).to(dtype)

    return {
        "x": randn(shape.rows, shape.hidden), "dy": randn(shape.rows, shape.hidden), "dh": randn(shape.rows, shape.ffn),
        "w_gate": randn(shape.experts, shape.ffn, shape.hidden), "w_up": randn(shape.experts, shape.ffn, shape.hidden),
        "w_down": randn(shape.experts, shape.hidden, shape.ffn),
    }


def _grouped_mm_gemms(t: dict[str, Tensor], offs: Tensor) -> None:
    """The nine GEMMs as ``F.grouped_mm``, in the layouts autograd uses for ``grouped_mm(x, w.mT)``."""
    x, dy, dh, w_gate, w_up, w_down = t["x"], t["dy"], t["dh"], t["w_gate"], t["w_up"], t["w_down"]
    F.grouped_mm(x, w_gate.transpose(-2, -1), offs=offs)  # forward: gate, up, down
    F.grouped_mm(x, w_up.transpose(-2, -1), offs=offs)
    F.grouped_mm(dh, w_down.transpose(-2, -1), offs=offs)
    F.grouped_mm(dy, w_down, offs=offs)  # input gradients: down, gate, up
    F.grouped_mm(dh, w_gate, offs=offs)
    F.grouped_mm(dh, w_up, offs=offs)
    F.grouped_mm(dy.t(), dh, offs=offs)  # weight gradients: down [E, H, F], gate and up [E, F, H]
    F.grouped_mm(dh.t(), x, offs=offs)
    F.grouped_mm(dh.t(), x, offs=offs)


def floor_case(shape: Shape, dtype: torch.dtype, device: torch.device) -> Case:
    """Nine balanced ``grouped_mm`` calls: the reference floor."""
    t = _floor_tensors(shape, dtype, device)
    offs = (torch.arange(1, shape.experts + 1, device=device) * (shape.rows // shape.experts)).to(torch.int32)
    return Case("floor: 9 grouped_mm GEMMs", _synced(lambda: _grouped_mm_gemms(t, offs), device),
                f"{FLOOR_ROUTING}; no activation, no autograd")


def floor_upcast_case(shape: Shape, dtype: torch.dtype, device: torch.device) -> Case:
    """The grouped_mm floor with low-precision operands converted to fp32 per GEMM (conversions timed)."""
    t = _floor_tensors(shape, dtype, device)
    offs = (torch.arange(1, shape.experts + 1, device=device) * (shape.rows // shape.experts)).to(torch.int32)

    def step() -> None:
        _grouped_mm_gemms({k: v.float() for k, v in t.items()}, offs)

    return Case("floor: 9 grouped_mm GEMMs, operands upcast to fp32", _synced(step, device),
                f"{FLOOR_ROUTING}; {_dtype_name(dtype)} operands converted to fp32 every step (timed)")


def bmm_floor_case(shape: Shape, dtype: torch.dtype, device: torch.device) -> Case:
    """The same nine GEMMs as ``torch.bmm`` on ``[E, N/E, *]``."""
    t = _floor_tensors(shape, dtype, device)
    e, n = shape.experts, shape.rows // shape.experts
    x, dy, dh = t["x"].view(e, n, -1), t["dy"].view(e, n, -1), t["dh"].view(e, n, -1)
    w_gate, w_up, w_down = t["w_gate"], t["w_up"], t["w_down"]

    def step() -> None:
        torch.bmm(x, w_gate.transpose(1, 2))
        torch.bmm(x, w_up.transpose(1, 2))
        torch.bmm(dh, w_down.transpose(1, 2))
        torch.bmm(dy, w_down)
        torch.bmm(dh, w_gate)
        torch.bmm(dh, w_up)
        torch.bmm(dy.transpose(1, 2), dh)
        torch.bmm(dh.transpose(1, 2), x)
        torch.bmm(dh.transpose(1, 2), x)

    return Case("floor: 9 bmm GEMMs [E, N/E, *]", _synced(step, device), f"{FLOOR_ROUTING}; same GEMMs as torch.bmm")


def onednn_floor_case(shape: Shape, dtype: torch.dtype, device: torch.device) -> Case:
    """The nine balanced GEMMs expert by expert through oneDNN, in the expert kernel's layouts.

    The floor of the CPU GEMM library `MoELayer` picks where oneDNN beats the BLAS behind
    ``torch.mm`` (see ``lightning_moe.layers.cpu_gemm``); N/E rows need no padding at S and M.
    """
    t = _floor_tensors(shape, dtype, device)
    e, n = shape.experts, shape.rows // shape.experts
    x, dy, dh = t["x"].view(e, n, -1), t["dy"].view(e, n, -1), t["dh"].view(e, n, -1)
    w_gate, w_up, w_down = t["w_gate"], t["w_up"], t["w_down"]
    g_gate, g_up, g_down = torch.empty_like(w_gate), torch.empty_like(w_up), torch.empty_like(w_down)

    def step() -> None:
        for i in range(e):
            OneDnnGemm.nt(x[i], w_gate[i])
            OneDnnGemm.nt(x[i], w_up[i])
            OneDnnGemm.nt(dh[i], w_down[i])
            OneDnnGemm.nn(dy[i], w_down[i])
            OneDnnGemm.nn(dh[i], w_gate[i])
            OneDnnGemm.nn(dh[i], w_up[i])
            OneDnnGemm.tn_into(dy[i], dh[i], g_down[i])
            OneDnnGemm.tn_into(dh[i], x[i], g_gate[i])
            OneDnnGemm.tn_into(dh[i], x[i], g_up[i])

    return Case("floor: 9 GEMMs per expert through oneDNN", step,
                f"{FLOOR_ROUTING}; the CPU GEMM library MoELayer uses here (weight gradients copied out)")


def uses_onednn(shape: Shape, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `MoELayer`'s expert kernel runs its GEMMs through oneDNN for this suite."""
    gate_up = 2 * shape.ffn  # SwiGLU fc1
    return gemm_for(device, dtype, shape.hidden, gate_up) is OneDnnGemm


def with_cpu_gemm(step: Callable[[], None], backend: str) -> Callable[[], None]:
    """``step`` with the expert kernel's CPU GEMM library forced to ``backend``."""

    def run() -> None:
        with use_cpu_gemm_backend(backend):
            step()

    return run


def module_case(name: str, module: nn.Module, forward, shape: Shape, dtype: torch.dtype, notes: str,
                device: torch.device | None = None, num_inputs: int = 1) -> Case:
    """Forward + backward of ``forward([T, H]) -> [T, H]`` with a fixed upstream gradient.

    ``num_inputs > 1`` cycles through that many different inputs, so the routing (and every
    expert's row count) changes from one step to the next, as in training.
    """
    device = device or torch.device("cpu")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape.tokens, shape.hidden, generator=gen).to(device=device, dtype=dtype)
    grad = torch.randn(shape.tokens, shape.hidden, generator=gen).to(device=device, dtype=dtype)
    inputs = [x] + [torch.randn(shape.tokens, shape.hidden, generator=gen).to(device=device, dtype=dtype)
                    for _ in range(num_inputs - 1)]
    params = [p for p in module.parameters() if p.requires_grad]
    calls = iter(range(1 << 62))

    def step():
        for p in params:
            p.grad = None
        inp = inputs[next(calls) % len(inputs)].detach().requires_grad_()
        forward(inp).backward(grad)

    return Case(name, _synced(step, device), notes)


class IdentityExperts(nn.Module):
    """Stand-in for `GroupedExperts` that multiplies each routed row by its probability.

    It keeps the experts' interface and their fused permutation: with ``row_index`` (the local
    dispatcher) it gathers the routed rows from the tokens, scales them and scatter-adds them back
    per token, exactly the data movement the expert kernel fuses around its GEMMs. The layer's time
    with these experts is therefore the router + permutation overhead of `MoELayer`.
    """

    def forward(self, tokens: Tensor, tokens_per_expert: list[int], probs: Tensor,
                row_index: Tensor | None = None, num_out_rows: int | None = None) -> Tensor:
        rows = tokens if row_index is None else tokens.index_select(0, row_index)
        out = rows * probs.unsqueeze(-1).to(rows.dtype)
        if row_index is None:
            return out
        return out.new_zeros(num_out_rows, out.shape[1]).index_add(0, row_index, out)


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def ours_cases(shape: Shape, dtype: torch.dtype, device: torch.device) -> list[Case]:
    """`MoELayer` with the device's default kernel (and grouped_mm on CPU fp32), and its overhead."""
    config = MoEConfig(shape.hidden, shape.ffn, shape.experts, top_k=shape.top_k)
    routing = f"routing: real softmax top-{shape.top_k} (renormalised), dropless"
    cases = []
    for requested in ("auto", "grouped_mm"):
        torch.manual_seed(0)  # same weights for every variant
        layer = MoELayer(config, expert_kernel=requested).to(device=device, dtype=dtype)
        kernel = layer.experts.resolved_kernel(device)
        if requested == "auto":
            onednn = kernel == "loop" and uses_onednn(shape, dtype, device)
            gemm_note = "; CPU GEMMs through oneDNN" if onednn else ""
            cases.append(module_case("lightning_moe MoELayer", layer, layer, shape, dtype,
                                     f"{routing}; kernel={kernel} (the default on {device.type}){gemm_note}", device))
            if onednn:
                cases.append(module_case(
                    "lightning_moe MoELayer [new routing every step]", layer, layer, shape, dtype,
                    f"{routing}; {NEW_ROUTING_INPUTS} inputs in turn: expert row counts (oneDNN shapes) change "
                    "every step", device, num_inputs=NEW_ROUTING_INPUTS))
                aten = module_case("lightning_moe MoELayer [CPU GEMMs through torch.mm]", layer, layer, shape,
                                   dtype, f"{routing}; kernel=loop with set_cpu_gemm_backend('aten')", device)
                aten.step = with_cpu_gemm(aten.step, "aten")
                cases.append(aten)
            # The other kernel only where it is cheap to time (CPU bf16 grouped_mm runs bf16 GEMMs).
            if kernel == "grouped_mm" or dtype != torch.float32 or not hasattr(F, "grouped_mm"):
                break
        else:
            cases.append(module_case("lightning_moe MoELayer [kernel=grouped_mm]", layer, layer, shape, dtype,
                                     f"{routing}; kernel=grouped_mm", device))
    torch.manual_seed(0)
    overhead = MoELayer(config).to(device=device, dtype=dtype)
    overhead.experts = IdentityExperts()
    cases.append(module_case(
        "overhead: lightning_moe router + permutation", overhead, overhead, shape, dtype,
        f"{routing}; identity experts (row * prob): router, expert ordering, gather, scatter-add", device,
    ))
    return cases


def lora_cases(shape: Shape, dtype: torch.dtype, device: torch.device) -> list[Case]:
    """The layer with a LoRA adapter per expert (fc1 and fc2, rank ``LORA_RANK``) and the same layer
    without it, both with frozen expert weights and grouped_mm GEMMs (what a LoRA fine-tune runs):
    their time ratio is what the adapters cost. Empty where torch has no ``grouped_mm``."""
    if not hasattr(F, "grouped_mm"):
        return []
    config = MoEConfig(shape.hidden, shape.ffn, shape.experts, top_k=shape.top_k)
    routing = f"routing: real softmax top-{shape.top_k} (renormalised), dropless"
    cases = []
    for name in (LORA_BASELINE_NAME, LORA_NAME):
        torch.manual_seed(0)
        layer = MoELayer(config, expert_kernel="grouped_mm")
        note = f"{routing}; kernel=grouped_mm, expert weights frozen (no weight gradients)"
        if name == LORA_NAME:
            LoRAGroupedExperts.convert(layer.experts, LORA_RANK, 2.0, 0.0, seed=0)
            with torch.no_grad():  # a trained adapter (B = 0 would be the same work anyway)
                layer.experts.fc1_lora_B.normal_(0.0, 0.02)
                layer.experts.fc2_lora_B.normal_(0.0, 0.02)
            note = f"{routing}; per-expert adapters as 2 more grouped GEMMs per projection, expert weights frozen"
        layer.experts.fc1_weight.requires_grad_(False)
        layer.experts.fc2_weight.requires_grad_(False)
        layer.to(device=device, dtype=dtype)
        cases.append(module_case(name, layer, layer, shape, dtype, note, device))
    return cases


def peer_cases(names: list[str], shape: Shape, dtype: torch.dtype, device: torch.device,
               include_slow: bool) -> tuple[list[Case], dict[str, str]]:
    if not names:
        return [], {}
    import peers

    skipped: dict[str, str] = {}
    order = list(SHAPES)
    slow = [n for n, largest in SLOW_ON_CPU.items() if n in names and order.index(shape.name) > order.index(largest)]
    if device.type == "cpu" and slow and not include_slow and bf16_gemms_are_slow():
        for name in slow:
            skipped[name] = (f"computes in bf16, whose GEMMs are slow on this CPU: skipped beyond config "
                             f"{SLOW_ON_CPU[name]}; --include-slow runs it")
        names = [n for n in names if n not in skipped]
    built, failed = peers.build_all(
        names, tokens=shape.tokens, hidden=shape.hidden, ffn=shape.ffn, experts=shape.experts,
        top_k=shape.top_k, dtype=dtype, seed=0,
    )
    skipped.update(failed)
    for p in built:
        p.module.to(device)
    return [module_case(p.name, p.module, p.forward, shape, dtype, p.notes, device) for p in built], skipped


def run_suite(shape: Shape, dtype_name: str, peer_names: list[str], rounds: int, device: torch.device,
              include_slow: bool = False) -> str:
    dtype = DTYPES[dtype_name]
    floor = floor_case(shape, dtype, device)
    floors = [floor, bmm_floor_case(shape, dtype, device)]
    if uses_onednn(shape, dtype, device):
        floors.append(onednn_floor_case(shape, dtype, device))
    if dtype != torch.float32 and device.type == "cpu":
        floors.append(floor_upcast_case(shape, dtype, device))
    peers_built, skipped = peer_cases(peer_names, shape, dtype, device, include_slow)
    lora = lora_cases(shape, dtype, device)
    cases = [*floors, *ours_cases(shape, dtype, device), *lora, *peers_built]
    run_interleaved(cases, rounds=rounds, warmup=2 if device.type == "cuda" else 1)
    title = (
        f"{shape.name} {dtype_name}: tokens {shape.tokens}, hidden {shape.hidden}, ffn {shape.ffn}, "
        f"{shape.experts} experts, top-{shape.top_k} ({rounds} rounds; floor "
        f"{shape.gemm_flops / floor.median / 1e9:.0f} GFLOP/s, {shape.gemm_flops / 1e9:.1f} GFLOP per step)"
    )
    table = ratio_table(title, cases, floor)
    if lora:
        plain, adapted = lora
        table += (f"\n\nLoRA layer / plain layer (r={LORA_RANK}, both frozen, grouped_mm): "
                  f"{adapted.median / plain.median:.3f}x median, {adapted.best / plain.best:.3f}x best")
    if skipped:
        table += "\n\nSkipped: " + "; ".join(f"{k} ({v})" for k, v in skipped.items())
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--configs", default="", help="comma-separated: S, M, L (default: S,M on cpu, L on cuda)")
    parser.add_argument("--dtypes", default="",
                        help="comma-separated: fp32, bf16, for every config (default: S fp32,bf16; M fp32; L bf16)")
    parser.add_argument("--peers", default="all", help="'all' (every installed peer), 'none' or comma-separated names")
    parser.add_argument("--rounds", type=int, default=0,
                        help="timed rounds (default: CPU 7 at S, 3 at M, 2 in bf16; CUDA 10)")
    parser.add_argument("--include-slow", action="store_true",
                        help="run torchtitan beyond config S on CPUs with slow bf16 GEMMs")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (default: 2 on cpu, torch's default on cuda)")
    parser.add_argument("--output", default="", help="also write the tables to this markdown file")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    threads = args.threads or (2 if device.type == "cpu" else torch.get_num_threads())
    torch.set_num_threads(threads)
    if args.peers == "all":
        import peers

        peer_names = list(peers.available_peers())
    else:
        peer_names = [] if args.peers == "none" else args.peers.split(",")
    configs = (args.configs or DEFAULT_CONFIGS[device.type]).split(",")
    for config in configs:
        if config not in SHAPES:
            parser.error(f"unknown config {config!r}; choose from {', '.join(SHAPES)}")
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda" else
               f"{platform.processor() or platform.machine()}, {threads} threads, "
               f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    header = (
        f"Command: `python benchmarks/moe_layer.py {' '.join(argv if argv is not None else sys.argv[1:])}`  \n"
        f"Machine: {machine}, torch {torch.__version__}"
    )
    tables = [header]
    print(header, flush=True)
    for config in configs:
        for dtype_name in (args.dtypes or DEFAULT_DTYPES[config]).split(","):
            rounds = args.rounds or default_rounds(SHAPES[config], dtype_name, device)
            table = run_suite(SHAPES[config], dtype_name, peer_names, rounds, device, args.include_slow)
            print("\n" + table, flush=True)
            tables.append(table)
    write_tables(args.output, tables)


if __name__ == "__main__":
    main()
