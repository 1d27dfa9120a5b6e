"""Checkpoints of expert-parallel models reshard: written at one EP/ETP layout, loaded at another.

Recipe (what these tests exercise, and what users do):

Save, on every rank of a parallelized model (gloo or nccl)::

    import torch.distributed.checkpoint as dcp
    dcp.save(model.state_dict(), checkpoint_id=ckpt_dir)

``model.state_dict()`` holds the public format of docs/architecture.md §6 with *global* shapes: the
expert tensors are DTensors on ``ctx.expert_mesh`` sharded over EP (and ETP), everything else
plain tensors (replicated; DCP writes one copy).

Load, on every rank of a model parallelized at any layout (same or different EP / ETP), with
``lightning_moe.checkpoint.sharded.load_sharded`` (``dcp.load`` with the reader and planner that
refuse code in a checkpoint; what `MoEStrategy` loads with too)::

    state = model.state_dict()                 # DTensors of *this* layout, global shapes
    load_sharded(state, ckpt_dir)              # fills them in place, each rank reading its slice
    model.load_state_dict(state)

Load on one device, no process group at all (recent torch detects that there is none)::

    state = model.state_dict()                 # plain tensors of the single-device model
    load_sharded(state, ckpt_dir)
    model.load_state_dict(state)

or consolidate a checkpoint you trust into one ``torch.save`` file first (DCP's converter
unpickles with ``weights_only=False``)::

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(ckpt_dir, "model.pt")
    model.load_state_dict(torch.load("model.pt"))

A plain single-device ``state_dict()`` (regular global tensors, e.g. converted from Hugging Face)
loads straight into a parallelized model with ``model.load_state_dict(plain)``: each rank keeps
its slice.

Oracle: the model is built after ``torch.manual_seed(0)`` on every rank, so every layout starts
from the same weights as the single-device model. Before saving, the weights take one SGD step on
a random loss over a global batch (each rank's share of the tokens), which the single-device model
also takes on the whole batch, so the checkpoint holds non-initial weights that equal the
single-device step within the fp32 gradient tolerance. After that, every load is compared
*exactly* against the values that were saved.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.dist import run_distributed
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_moe import MoEConfig
from lightning_moe.checkpoint.sharded import SafeFileSystemReader, load_sharded
from lightning_moe.layers.moe import MoELayer
from lightning_moe.parallel import ParallelDims, build_parallel_context, is_expert_param, parallelize

pytestmark = pytest.mark.distributed

H, F, FS, E, TOP_K = 16, 8, 8, 8, 2
"""Hidden, expert ffn (divisible by ETP=4), shared-expert ffn, experts, top-k."""
GLOBAL_TOKENS = 24
"""Tokens of the global batch of the perturbing step (split evenly over the ranks)."""
LR = 0.5
"""SGD step size: moves the weights far beyond fp32 noise (init std is 0.02)."""
STEP_ATOL = LR * 1e-4
"""Parallel vs single-device weights after one step: LR times the fp32 gradient tolerance (1e-4)."""
MIN_CHANGE = 1e-4
"""Every tensor must move at least this much in the step (the checkpoint is not the init); the
smallest move (router) is ~1e-3, parallel-vs-single-device differences ~1e-8."""


class TwoMoE(nn.Module):
    """Two residual MoE layers (swiglu). Variant ``fc2_bias=True``: layer 0 has an expert fc2 bias
    (whole on every ETP rank); layer 1 always has no bias and a gated shared expert."""

    def __init__(self, fc2_bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [
                MoELayer(MoEConfig(H, F, E, top_k=TOP_K, fc2_bias=fc2_bias)),
                MoELayer(
                    MoEConfig(
                        H,
                        F,
                        E,
                        top_k=TOP_K,
                        fc2_bias=False,
                        shared_expert_ffn_hidden_size=FS,
                        shared_expert_gate=True,
                    )
                ),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def build_model(fc2_bias: bool) -> TwoMoE:
    torch.manual_seed(0)
    return TwoMoE(fc2_bias)


def public_format(fc2_bias: bool) -> dict[str, tuple[int, ...]]:
    """Keys and global shapes of docs/architecture.md §6 for `TwoMoE`, at every layout."""
    fmt = {}
    for i in (0, 1):
        fmt[f"layers.{i}.router.weight"] = (E, H)
        fmt[f"layers.{i}.experts.fc1_weight"] = (E, 2, F, H)  # gated: (gate, up)
        fmt[f"layers.{i}.experts.fc2_weight"] = (E, H, F)
    if fc2_bias:
        fmt["layers.0.experts.fc2_bias"] = (E, H)
    fmt["layers.1.shared_expert.fc1.weight"] = (2 * FS, H)
    fmt["layers.1.shared_expert.fc2.weight"] = (H, FS)
    fmt["layers.1.shared_expert.gate.weight"] = (1, H)
    return fmt


def is_expert_key(key: str) -> bool:
    return ".experts." in key


def full_values(state: dict) -> dict[str, torch.Tensor]:
    """Global values of a state dict (DTensors gathered), detached CPU copies."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def check_public_format(state: dict, fc2_bias: bool, ctx) -> None:
    """Keys and global shapes exactly the public format; expert tensors are DTensors on the expert mesh."""
    assert {k: tuple(v.shape) for k, v in state.items()} == public_format(fc2_bias)
    for key, value in state.items():
        if is_expert_key(key):
            assert isinstance(value, DTensor), key
            assert value.device_mesh == ctx.expert_mesh, key
        else:
            assert not isinstance(value, DTensor), key


def expected_local(full: torch.Tensor, key: str, ctx) -> torch.Tensor:
    """This rank's slice of a global tensor, written independently of the library's slicing."""
    if not is_expert_key(key):
        return full
    nle, block = E // ctx.size("ep"), F // ctx.size("etp")
    experts = full[ctx.rank_in("ep") * nle : (ctx.rank_in("ep") + 1) * nle]
    f = slice(ctx.rank_in("etp") * block, (ctx.rank_in("etp") + 1) * block)
    if key.endswith("fc1_weight"):  # [n, 2, F, H] -> stored [n, 2 * block, H]: gate block, then up block
        gate, up = experts[:, 0], experts[:, 1]
        return torch.cat([gate[:, f], up[:, f]], dim=1)
    if key.endswith("fc2_weight"):
        return experts[:, :, f]
    return experts  # fc2_bias


def check_local_params(model: nn.Module, ctx, expected: dict[str, torch.Tensor], what: str) -> None:
    for key, full in expected.items():
        local = model.get_parameter(key).detach()
        assert torch.equal(local, expected_local(full, key, ctx)), f"{what}: {key} is not this rank's slice"


def check_full(state: dict, expected: dict[str, torch.Tensor], what: str) -> None:
    got = full_values(state)
    assert got.keys() == expected.keys(), what
    for key in expected:
        assert torch.equal(got[key], expected[key]), f"{what}: {key} differs from the saved value"


def make_ctx(world_size: int, layout: dict):
    return build_parallel_context(ParallelDims(world_size, **layout), "cpu")


# -- rank functions ------------------------------------------------------------------------------------


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_TOKENS, H, generator=gen), torch.randn(GLOBAL_TOKENS, H, generator=gen)


def _step_and_save(fc2_bias: bool, layout: dict, ckpt_dir: str) -> dict:
    """Parallelize, take one SGD step on this rank's tokens (single-device model on all of them),
    save with DCP. Returns the saved global values and how they compare with the single-device step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = make_ctx(world, layout)
    ref = build_model(fc2_bias)
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    model = parallelize(copy.deepcopy(ref), ctx)
    x, w = _global_batch()

    (ref(x) * w).sum().backward()
    torch.optim.SGD(ref.parameters(), lr=LR).step()

    mine = slice(rank * GLOBAL_TOKENS // world, (rank + 1) * GLOBAL_TOKENS // world)
    (model(x[mine]) * w[mine]).sum().backward()
    for param in model.parameters():
        # Sum loss: expert grads are complete within the EP x ETP group, summed over expert-DP;
        # dense grads are summed over DP (TP=1 here).
        dist.all_reduce(param.grad, group=ctx.group("edp" if is_expert_param(param) else "dp"))
    torch.optim.SGD(model.parameters(), lr=LR).step()

    state = model.state_dict()
    check_public_format(state, fc2_bias, ctx)
    saved = full_values(state)
    dcp.save(state, checkpoint_id=ckpt_dir)
    reference = ref.state_dict()
    return {
        "saved": saved,
        "step_error": {k: (saved[k] - reference[k]).abs().max().item() for k in saved},
        "step_change": {k: (reference[k] - init[k]).abs().max().item() for k in saved},
    }


def _load_checkpoint(fc2_bias: bool, layout: dict, ckpt_dir: str, saved: dict) -> None:
    """A freshly initialised model at ``layout`` loads the checkpoint: exact slices and global values."""
    ctx = make_ctx(dist.get_world_size(), layout)
    model = parallelize(build_model(fc2_bias), ctx)
    state = model.state_dict()
    check_public_format(state, fc2_bias, ctx)
    load_sharded(state, ckpt_dir)
    model.load_state_dict(state)
    what = f"{layout} loading {ckpt_dir}"
    check_local_params(model, ctx, saved, what)
    after = model.state_dict()
    check_public_format(after, fc2_bias, ctx)
    check_full(after, saved, what)


def _load_plain(fc2_bias: bool, layout: dict, saved: dict) -> None:
    """A plain single-device state dict (regular global tensors) gives each rank its slices."""
    ctx = make_ctx(dist.get_world_size(), layout)
    model = parallelize(build_model(fc2_bias), ctx)
    model.load_state_dict({k: v.clone() for k, v in saved.items()})
    what = f"{layout} loading a plain state dict"
    check_local_params(model, ctx, saved, what)
    check_full(model.state_dict(), saved, what)


def _load_other_dtensors(fc2_bias: bool, layout: dict, saved: dict) -> None:
    """Expert DTensors on another mesh / sharding (world mesh, Shard(0)) are accepted too."""
    ctx = make_ctx(dist.get_world_size(), layout)
    model = parallelize(build_model(fc2_bias), ctx)
    world_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    other = {
        k: distribute_tensor(v.clone(), world_mesh, [Shard(0)]) if is_expert_key(k) else v.clone()
        for k, v in saved.items()
    }
    model.load_state_dict(other)
    check_local_params(model, ctx, saved, f"{layout} loading world-mesh DTensors")


def _save_on_two(rank: int, world_size: int, ckpt_bias: str, ckpt_etp1: str) -> dict:
    return {
        "bias": _step_and_save(True, {"ep": 2}, ckpt_bias),
        "etp1": _step_and_save(False, {"ep": 2}, ckpt_etp1),
    }


def _save_on_four(rank: int, world_size: int, ckpt_etp2: str) -> dict:
    return {"etp2": _step_and_save(False, {"ep": 2, "etp": 2}, ckpt_etp2)}


def _reshard_on_four(rank: int, world_size: int, ckpts: dict, saved: dict) -> str:
    # fc2_bias variant: EP=2 -> EP=4, EP=2 with expert-DP=2, and ETP=2 / ETP=4 (the bias whole on each ETP rank).
    for layout in ({"ep": 4}, {"ep": 2}, {"ep": 2, "etp": 2}, {"etp": 4}):
        _load_checkpoint(True, layout, ckpts["bias"], saved["bias"])
    # ETP=1 -> ETP=2, ETP=4 (EP=1), and ETP=2 -> EP=4 / ETP=4.
    for layout in ({"ep": 2, "etp": 2}, {"etp": 4}, {"ep": 4}):
        _load_checkpoint(False, layout, ckpts["etp1"], saved["etp1"])
    for layout in ({"ep": 4}, {"etp": 4}, {"ep": 2, "etp": 2}):
        _load_checkpoint(False, layout, ckpts["etp2"], saved["etp2"])
    return "ok"


def _reshard_on_two(rank: int, world_size: int, ckpts: dict, saved: dict) -> str:
    # ETP=2 (4 ranks) -> EP=2, ETP=1 and EP=1, ETP=2; and the same layout round trip.
    for layout in ({"ep": 2}, {"etp": 2}):
        _load_checkpoint(False, layout, ckpts["etp2"], saved["etp2"])
    for layout in ({"ep": 2}, {"etp": 2}):
        _load_checkpoint(True, layout, ckpts["bias"], saved["bias"])
    return "ok"


def _plain_loads(rank: int, world_size: int, saved: dict) -> str:
    if world_size == 4:
        _load_plain(True, {"ep": 4}, saved["bias"])
        _load_plain(True, {"ep": 2, "etp": 2}, saved["bias"])
        _load_plain(False, {"ep": 2, "etp": 2}, saved["etp1"])
        _load_plain(False, {"etp": 4}, saved["etp2"])
        _load_other_dtensors(False, {"ep": 2, "etp": 2}, saved["etp1"])
    else:
        _load_plain(True, {"ep": 2}, saved["bias"])
        _load_plain(False, {"etp": 2}, saved["etp2"])
        _load_other_dtensors(True, {"ep": 2}, saved["bias"])
    return "ok"


def _round_trip_one_layer(rank: int, world_size: int) -> str:
    ctx = make_ctx(world_size, {"ep": world_size})
    layer = parallelize(build_model(False), ctx).layers[0]
    layer.load_state_dict(layer.state_dict())
    return "ok"


# -- tests -----------------------------------------------------------------------------------------------


def test_parallel_layer_loads_its_own_state_dict(tmp_path):
    """Smallest load: one sharded MoELayer at EP=2 takes back its own ``state_dict()``."""
    assert run_distributed(_round_trip_one_layer, 2, tmp_dir=tmp_path) == ["ok"] * 2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Three DCP checkpoints of stepped models: fc2-bias variant at EP=2, no-bias variant at EP=2
    (ETP=1) and at EP=2, ETP=2. Returns (paths, per-rank results, saved global values)."""
    root = tmp_path_factory.mktemp("dcp")
    paths = {name: str(root / name) for name in ("bias", "etp1", "etp2")}
    two = run_distributed(_save_on_two, 2, paths["bias"], paths["etp1"], tmp_dir=root)
    four = run_distributed(_save_on_four, 4, paths["etp2"], tmp_dir=root)
    per_rank = {name: [r[name] for r in (four if name == "etp2" else two)] for name in paths}
    saved = {name: results[0]["saved"] for name, results in per_rank.items()}
    return paths, per_rank, saved


def test_saved_weights_are_the_single_device_step(checkpoints):
    """Before saving: the public format at EP=2 and EP=2/ETP=2 (checked on the ranks), every rank
    sees the same global values, they moved away from the init, and equal the one-device step."""
    _, per_rank, saved = checkpoints
    for name, results in per_rank.items():
        assert saved[name].keys() == public_format(name == "bias").keys()
        for result in results[1:]:
            for key, value in result["saved"].items():
                assert torch.equal(value, saved[name][key]), f"{name}: ranks disagree on {key}"
        for key, change in results[0]["step_change"].items():
            assert change > MIN_CHANGE, f"{name}: {key} did not move in the step ({change})"
        for key, error in results[0]["step_error"].items():
            assert error <= STEP_ATOL, f"{name}: {key} differs from the single-device step by {error}"


def test_checkpoint_metadata_holds_global_shapes(checkpoints):
    """What DCP wrote: exactly the public keys, with global shapes, whatever layout saved it."""
    paths, _, _ = checkpoints
    for name, path in paths.items():
        metadata = SafeFileSystemReader(path).read_metadata().state_dict_metadata
        assert {k: tuple(m.size) for k, m in metadata.items()} == public_format(name == "bias"), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("name", ["bias", "etp1", "etp2"])
def test_load_on_one_device_without_process_group(checkpoints, name, tmp_path):
    """EP=1, no process group: ``load_sharded`` into the plain model, and via ``dcp_to_torch_save``."""
    paths, _, saved = checkpoints
    assert not dist.is_initialized()
    model = build_model(name == "bias")
    state = model.state_dict()
    load_sharded(state, paths[name])
    model.load_state_dict(state)
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[name][key]), key

    consolidated = tmp_path / "model.pt"
    dcp_to_torch_save(paths[name], consolidated)
    plain = torch.load(consolidated, weights_only=True)
    fresh = build_model(name == "bias")
    fresh.load_state_dict(plain)
    assert fresh.state_dict().keys() == saved[name].keys()
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, saved[name][key]), key


def test_reshard_on_four_ranks(checkpoints, tmp_path):
    """EP=2 -> EP=4 / EP=2 x EDP=2; ETP=1 <-> ETP=2; ETP=1 or 2 -> EP=1 x ETP=4 and EP=4; the fc2-bias
    variant from EP=2 to EP=2 x ETP=2 and ETP=4 too."""
    paths, _, saved = checkpoints
    assert run_distributed(_reshard_on_four, 4, paths, saved, tmp_dir=tmp_path) == ["ok"] * 4


def test_reshard_on_two_ranks(checkpoints, tmp_path):
    """ETP=2 (saved on 4 ranks) -> EP=2 x ETP=1 and EP=1 x ETP=2; the fc2-bias variant EP=2 -> EP=2
    round trip and EP=2 -> ETP=2."""
    paths, _, saved = checkpoints
    assert run_distributed(_reshard_on_two, 2, paths, saved, tmp_dir=tmp_path) == ["ok"] * 2


@pytest.mark.parametrize("world_size", [2, 4])
def test_plain_state_dict_loads_each_ranks_slice(checkpoints, world_size, tmp_path):
    """``load_state_dict`` of the single-device (regular tensor) state dict, and of expert DTensors
    sharded another way, keeps exactly this rank's slices."""
    _, _, saved = checkpoints
    assert run_distributed(_plain_loads, world_size, saved, tmp_dir=tmp_path) == ["ok"] * world_size
