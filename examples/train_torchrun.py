"""Train the reference MoE language model with plain ``torchrun``: the core library, no Lightning.

    torchrun --standalone --nproc_per_node=2 examples/train_torchrun.py --tp 1 --ep 2 --steps 20
    torchrun --standalone --nproc_per_node=4 examples/train_torchrun.py --tp 2 --etp 1 --ep 4 --save /tmp/ckpt

What ``MoEStrategy`` does for a LightningModule, written out step by step (model code is
single-device, parallelism is applied afterwards in one fixed order: docs/architecture.md §1-§2):

1. **Process group.** ``torchrun`` sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*``;
   ``init_process_group`` reads them: gloo on CPU, nccl on GPU (one GPU per process).
2. **Layout.** ``ParallelDims(world, tp, ep, etp)`` is pure rank arithmetic (it validates the
   sizes against the world size ``--nproc_per_node x --nnodes`` and derives dense
   DP = world / TP and expert EDP = world / (ETP x EP));
   ``build_parallel_context`` creates every process group and the dense / expert device meshes.
   It is collective: every rank calls it with the same sizes.
3. **Model.** ``MoETransformer(config)`` after ``torch.manual_seed(seed)`` with the *same* seed
   on every rank: the model and every MoE layer draw their seeds from the global RNG and every
   weight is a function of those seeds (experts of their global index), so all ranks hold the same
   full model without communicating. It is built directly on this process's device.
4. **Parallelize.** ``parallelize(model, ctx, dispatcher)``: tensor + sequence parallelism of
   attention and dense layers over TP (the output head keeps its logits sharded over the
   vocabulary: ``model(tokens)`` is this rank's ``V / TP`` slice and ``model.loss`` the
   vocabulary-parallel cross-entropy), then experts sharded over EP x ETP (each rank keeps its
   slice; the expert parameters are tagged so that steps 5 and 8 treat them as expert shards),
   with the token dispatcher bound to the expert groups. On CPU, ``agree_on_cpu_gemm(model)``
   makes every rank use the expert GEMM library rank 0 measured as fastest.
   ``set_aux_loss_scale(model, 1.0)``: the aux / z-loss gradients are scaled like the loss, which
   this loop does not scale (no GradScaler) or accumulate.
5. **Gradient sync.** ``GradSync(model, ctx)`` registers hooks on the parallelized parameters (so
   it comes after step 4). During backward it reduces gradient buckets asynchronously (dense over
   DP x CP, and over TP too for parameters replicated across it; experts over EDP; all pre-scaled
   by 1 / (DP x CP)); ``sync.finish()`` after ``backward()`` waits for them.
6. **Optimizer.** AdamW over the local parameters (shards included); plain ``torch.optim``.
7. **Data.** ``build_datasets(None, ...)`` reads the Python standard library's sources (nothing
   to download), byte-tokenised and packed. Each *dense data-parallel replica* takes its own
   samples: ``DistributedSampler(num_replicas=ctx.size("dp"), rank=ctx.rank_in("dp"))``, so the
   TP ranks of one replica read the same batch (they split its sequence among themselves).
8. **Train.** forward + ``loss.backward()`` (the MoE aux / z losses reach the gradients by
   themselves), ``sync.finish()``, ``clip_grad_norm_(params, max_norm, ctx)`` (one global norm
   over dense and expert shards, each element counted once), ``optimizer.step()``. Rank 0 prints
   the loss averaged over all ranks every ``--log-every`` steps.
9. **Checkpoint** (``--save DIR``): ``torch.distributed.checkpoint.save(model.state_dict(), ...)``.
   The state dict has global keys and shapes (expert and TP tensors are DTensors), so every rank
   writes its shards and the directory loads at any other layout, or in one process.

Runs from any working directory; it writes nothing unless ``--save`` is given.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader, DistributedSampler

try:
    import lightning_moe  # noqa: F401
except ImportError:  # a source checkout that is not pip-installed: use the repository's package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_moe import MoEConfig
from lightning_moe.data import ByteTokenizer, build_datasets
from lightning_moe.layers import set_aux_loss_scale
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims, allow_mixed_tensors, build_parallel_context, parallelize
from lightning_moe.parallel.cpu_gemm_agreement import agree_on_cpu_gemm
from lightning_moe.parallel.dispatchers import DISPATCHERS
from lightning_moe.parallel.grad_norm import clip_grad_norm_
from lightning_moe.parallel.grad_sync import GradSync


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    layout = parser.add_argument_group("layout (the world size comes from torchrun)")
    layout.add_argument("--tp", type=int, default=1, help="tensor parallel size (attention, dense layers)")
    layout.add_argument("--ep", type=int, default=1, help="expert parallel size")
    layout.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
    layout.add_argument("--dispatcher", choices=sorted(DISPATCHERS), default="alltoall", help="token dispatcher")
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=20, help="optimizer steps")
    train.add_argument("--batch", type=int, default=8, help="samples per step on each data-parallel replica")
    train.add_argument("--seq", type=int, default=64, help="tokens per sample (divisible by --tp)")
    train.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    train.add_argument("--warmup", type=int, default=5, help="linear learning-rate warm-up steps")
    train.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay of the matrices")
    train.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm to this")
    train.add_argument("--max-tokens", type=int, default=200_000, help="tokens read from the corpus")
    train.add_argument("--seed", type=int, default=1234, help="model and data seed (the same on every rank)")
    train.add_argument("--log-every", type=int, default=5, help="print the loss every N steps (rank 0)")
    train.add_argument("--save", type=Path, default=None, help="write a sharded checkpoint of the model here")
    train.add_argument("--cpu", action="store_true", help="train on the CPU even if CUDA is available")
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "seq", "warmup", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def model_config(seq_len: int) -> MoETransformerConfig:
    """The small model of ``examples/configs/tiny_cpu.yaml``: 2 MoE layers of 8 experts, top-2."""
    hidden = 64
    return MoETransformerConfig(
        vocab_size=ByteTokenizer().padded_vocab_size(64),  # 259 byte-level ids -> 320
        hidden_size=hidden, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=128,
        max_seq_len=seq_len,
        moe=MoEConfig(
            hidden_size=hidden, ffn_hidden_size=64, num_experts=8, top_k=2,
            load_balancing=["aux_loss"], aux_loss_coeff=0.01, z_loss_coeff=0.001,
        ),
    )


def init_distributed(force_cpu: bool) -> torch.device:
    """Step 1: the default process group (gloo on CPU, nccl on GPU) and this process's device."""
    if "RANK" not in os.environ:
        raise SystemExit("Launch with torchrun, e.g. torchrun --standalone --nproc_per_node=2 " + sys.argv[0])
    if torch.cuda.is_available() and not force_cpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (experts included) decay; vectors (norms, biases) and the embedding do not
    (the grouping of ``lightning_moe.lit.optimizer_param_groups``)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    decay = [p for name, p in named if p.dim() >= 2 and "embed" not in name]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": [p for _, p in named if not any(p is q for q in decay)], "weight_decay": 0.0},
    ]


def mean_over_world(value: torch.Tensor) -> float:
    """The average of a scalar over all ranks (gloo has no AVG reduction: sum, then divide).

    The TP ranks of a replica compute the same loss (the logits are gathered over TP), so for the
    loss this is the mean over the data-parallel replicas.
    """
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = init_distributed(args.cpu)
    rank = dist.get_rank()

    # 2. Layout: process groups and meshes of every parallel dimension.
    dims = ParallelDims(dist.get_world_size(), tp=args.tp, ep=args.ep, etp=args.etp)
    ctx = build_parallel_context(dims, device.type)

    # 3. The single-device model, from the same seed on every rank.
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = MoETransformer(model_config(args.seq))
    # 4. Parallelize: TP/SP, then EP/ETP (this rank keeps its shards).
    parallelize(model, ctx, dispatcher=args.dispatcher)
    if device.type == "cpu":
        agree_on_cpu_gemm(model)  # every rank computes the experts with the GEMM library rank 0 chose
    # The aux / z-loss gradients scale like the loss: this loop neither scales nor accumulates it.
    set_aux_loss_scale(model, 1.0)
    model.train()
    # 5. Gradient sync hooks on the parallelized parameters, 6. the optimizer.
    sync = GradSync(model, ctx)
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup))

    # 7. Data: each dense data-parallel replica its own samples; the TP ranks of a replica share them.
    train_set, _ = build_datasets(None, args.seq, val_fraction=0.0, max_tokens=args.max_tokens)
    sampler = DistributedSampler(
        train_set, num_replicas=ctx.size("dp"), rank=ctx.rank_in("dp"), shuffle=True, seed=args.seed
    )
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, drop_last=True)
    if len(loader) == 0:
        raise SystemExit(f"--max-tokens {args.max_tokens} gives no full batch per replica; raise it.")
    if rank == 0:
        print(f"layout: {dims.describe()}, dispatcher={args.dispatcher}, device={device.type}", flush=True)
        print(f"model: {model.extra_repr()}; data: {len(train_set)} samples of {args.seq} tokens, "
              f"{len(loader)} batches of {args.batch} per replica and epoch", flush=True)

    # 8. Train.
    step, epoch, started = 0, 0, time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            if step == args.steps:
                break
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            loss = model.loss(inputs, targets)
            loss.backward()  # gradient buckets are reduced while backward runs ...
            sync.finish()  # ... and this waits for the last of them
            grad_norm = clip_grad_norm_(model.parameters(), args.clip, ctx)
            with allow_mixed_tensors():  # foreach/fused AdamW over DTensors and plain expert shards
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % args.log_every == 0 or step == args.steps:
                mean_loss = mean_over_world(loss)  # collective: every rank takes part
                if rank == 0:
                    print(f"step {step:5d}/{args.steps}  loss {mean_loss:.4f}  grad_norm {grad_norm.item():.3f}  "
                          f"lr {scheduler.get_last_lr()[0]:.2e}  {time.perf_counter() - started:.1f}s", flush=True)
        epoch += 1

    # 9. A sharded checkpoint with global keys (loads at any layout).
    if args.save is not None:
        dcp.save(model.state_dict(), checkpoint_id=args.save)
        if rank == 0:
            print(f"saved a sharded checkpoint of the model to {args.save}", flush=True)
    dist.barrier()  # every rank done communicating before any closes its connections
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
