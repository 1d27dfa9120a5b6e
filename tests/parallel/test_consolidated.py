"""A ``torch.save`` file written tensor by tensor, and sharded tensors gathered to one rank only.

Oracles: the tensors that were written (``torch.load(weights_only=True)``, with and without
``mmap``, gives them back exactly, dtypes included), and for :func:`gather_full` the full tensor
the DTensor was distributed from, on a 2 x 2 mesh of 4 gloo ranks at placements that cut it
along every dimension, unevenly, replicated and strided (FSDP2 over a tensor-parallel shard).
Full tensors loaded into a tensor-parallel model (as from a consolidated file) give back the same
full tensors, and each rank's shard is a view, not a copy. The reference transformer at TP=2, EP=2
on 4 ranks (tensor-parallel weights on 2-rank sub-meshes, experts over EP) is written consolidated
and equals the single-device model's state dict exactly; loaded back at that layout from the
memory-mapped file and written again, it still does.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.dist import run_distributed
from helpers.memory import HeldBytes
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_moe import MoEConfig
from lightning_moe.checkpoint.consolidated import gather_full, write_consolidated
from lightning_moe.checkpoint.security import load_torch_file
from lightning_moe.checkpoint.sharded import distribute_full_tensors
from lightning_moe.checkpoint.torch_file_stream import TorchFileStream
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize

BOOKKEEPING_BYTES = 1024
"""Index tensors of the mesh's size that DTensor's layout arithmetic creates (tens of bytes each)."""


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    return {
        "fp32": torch.randn(4, 3, generator=g),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "int64": torch.arange(9).reshape(3, 3),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "slice": base[2:4],  # a view into a larger storage: only its own bytes are written
        "transposed": base.t(),
        "tied": base,
        "tied_again": base,  # the same tensor under two keys (tied weights): written once, loads shared
    }


@pytest.mark.parametrize("mmap", [False, True])
def test_stream_loads_as_torch_save_does(tmp_path, mmap):
    tensors = _tensors()
    path = tmp_path / "stream.pt"
    with open(path, "wb") as file:
        stream = TorchFileStream(file)
        stored = {key: stream.add(value) for key, value in tensors.items()}
        stream.finish({"state_dict": stored, "epoch": 3, "left_in_object": torch.ones(2), "hparams": {"lr": 0.1}})
    loaded = torch.load(path, weights_only=True, mmap=mmap)
    assert loaded["epoch"] == 3 and loaded["hparams"] == {"lr": 0.1}
    torch.testing.assert_close(loaded["left_in_object"], torch.ones(2), rtol=0, atol=0)
    assert list(loaded["state_dict"]) == list(tensors)
    for key, value in tensors.items():
        got = loaded["state_dict"][key]
        assert type(got) is torch.Tensor and got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(got, value), key
    state = loaded["state_dict"]
    assert state["tied"].untyped_storage().data_ptr() == state["tied_again"].untyped_storage().data_ptr()


def test_a_legacy_format_file_is_read_when_it_cannot_be_mapped(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"state_dict": {"w": torch.ones(3)}}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(load_torch_file(path, mmap=True)["state_dict"]["w"], torch.ones(3))


def test_stream_writes_each_tensor_when_added(tmp_path):
    """The bytes reach the file at add(), not at finish(): nothing accumulates in memory."""
    path = tmp_path / "stream.pt"
    big = torch.randn(64, 64)
    with open(path, "wb") as file:
        stream = TorchFileStream(file)
        stream.add(big)
        file.flush()
        assert os.path.getsize(path) >= big.nbytes
        stream.finish({})


def _gather_cases() -> dict[str, tuple]:
    return {
        "shard both dims": (Shard(0), Shard(1)),
        "replicated then inner dim": (Replicate(), Shard(2)),
        "inner dim then replicated": (Shard(1), Replicate()),
        "dim 0 twice": (Shard(0), Shard(0)),
        "dim 1 twice (uneven)": (Shard(1), Shard(1)),
        "strided (FSDP2 over TP)": (_StridedShard(0, split_factor=2), Shard(0)),
        "replicated": (Replicate(), Replicate()),
        # On one mesh dimension only (as tensor-parallel and FSDP2 weights are): the ranks of the
        # other groups hold replicas and send nothing.
        "sub-mesh a, inner dim": ("a", Shard(1)),
        "sub-mesh b, dim 0": ("b", Shard(0)),
    }


def _gather(rank: int, world_size: int, root: str) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    full = torch.arange(8 * 5 * 3, dtype=torch.float32).reshape(8, 5, 3)  # 5 and 3: uneven over 2 and 4
    out = {}
    for name, placements in _gather_cases().items():
        on = mesh[placements[0]] if isinstance(placements[0], str) else mesh
        value = distribute_tensor(full, on, placements[1:] if isinstance(placements[0], str) else placements)
        with HeldBytes([value]) as held:
            got = gather_full(value, dst=0)
        out[name] = {"ok": torch.equal(got, full) if rank == 0 else got is None, "peak": held.peak}
    out["tensor_parallel_load"] = _load_into_tensor_parallel_model()
    _transformer_round_trip(Path(root))
    state = {"a": distribute_tensor(full, mesh, (Shard(1), Shard(0))), "b": torch.ones(3), "step": 4}
    write_consolidated(state, {"epoch": 1}, Path(root) / "model.pt")
    try:
        write_consolidated(state, {}, Path(root))  # a folder: rank 0 cannot open it
        out["error"] = None
    except IsADirectoryError as err:
        out["error"] = str(err)
    return out


def _load_into_tensor_parallel_model() -> dict:
    """Full tensors loaded into column- and row-parallel linears over 4 ranks: each rank's shard is
    a view of the full tensor (a column block of the row-parallel weight is not contiguous)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 64))  # shards above BOOKKEEPING_BYTES
    full = {key: torch.randn_like(value) for key, value in model.state_dict().items()}
    parallelize_module(model, init_device_mesh("cpu", (4,)), {"0": ColwiseParallel(), "1": RowwiseParallel()})
    with HeldBytes([*model.parameters(), *full.values()]) as held:
        model.load_state_dict(distribute_full_tensors(model, full), strict=True)
    loaded = {key: value.full_tensor() for key, value in model.state_dict().items()}
    return {"equal": all(torch.equal(loaded[key], value) for key, value in full.items()), "peak": held.peak}


def _transformer() -> MoETransformer:
    torch.manual_seed(0)  # the same weights on every rank and in the single-device model
    config = MoETransformerConfig(
        vocab_size=64, hidden_size=16, num_layers=2, num_attention_heads=2, num_kv_heads=2, ffn_hidden_size=32,
        max_seq_len=16, moe=MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2),
    )
    return MoETransformer(config)


def _transformer_round_trip(root: Path) -> None:
    """The reference transformer at TP=2, EP=2 (ETP=1, dense DP=2: tensor-parallel weights on
    2-rank sub-meshes) written consolidated, then loaded into the same layout and written again."""
    ctx = build_parallel_context(ParallelDims(dist.get_world_size(), tp=2, ep=2, etp=1), "cpu")
    model = parallelize(_transformer(), ctx)
    write_consolidated(model.state_dict(), {}, root / "transformer.pt")
    dist.barrier()
    fresh = parallelize(_transformer(), ctx)
    with torch.no_grad():  # nothing of the first model survives unless the load puts it back
        for param in fresh.parameters():
            param.zero_()
    full = load_torch_file(root / "transformer.pt", mmap=True)["state_dict"]
    fresh.load_state_dict(distribute_full_tensors(fresh, full), strict=True)
    write_consolidated(fresh.state_dict(), {}, root / "transformer_again.pt")


def test_gather_full_puts_the_whole_tensor_on_rank_zero_only(tmp_path):
    results = run_distributed(_gather, 4, str(tmp_path), timeout_s=60, tmp_dir=tmp_path)
    full_bytes = 8 * 5 * 3 * 4
    for rank, result in enumerate(results):
        for name in _gather_cases():
            assert result[name]["ok"], f"rank {rank}, {name}: wrong value"
            # Rank 0: the full tensor and at most one received piece; the others send their own data.
            bound = (2 * full_bytes if rank == 0 else 0) + BOOKKEEPING_BYTES
            assert result[name]["peak"] <= bound, f"rank {rank}, {name}: held {result[name]['peak']} > {bound}"
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert loaded["epoch"] == 1 and loaded["state_dict"]["step"] == 4
    assert torch.equal(loaded["state_dict"]["a"], torch.arange(120, dtype=torch.float32).reshape(8, 5, 3))
    assert torch.equal(loaded["state_dict"]["b"], torch.ones(3))
    for rank, result in enumerate(results):
        load = result["tensor_parallel_load"]
        assert load["equal"] and load["peak"] <= BOOKKEEPING_BYTES, f"rank {rank}: {load}"
    reference = _transformer().state_dict()
    for name in ("transformer.pt", "transformer_again.pt"):  # saved at TP=2/EP=2, and after loading it there
        state = torch.load(tmp_path / name, weights_only=True)["state_dict"]
        assert sorted(state) == sorted(reference), name
        for key, value in reference.items():
            assert torch.equal(state[key], value), f"{name} {key}"
    # The error is rank 0's alone, raised after the gathers: the other ranks returned normally.
    assert "Is a directory" in results[0]["error"] and all(r["error"] is None for r in results[1:])
