"""FSDP2 under `parallelize`: one root drives every unit, and each block prefetches its neighbour's all-gather.

On 4 forked gloo ranks (TP=1, EP=2: dense units over DP=4, experts over EDP=2), a 4-block
``MoETransformer`` (one dense block, three MoE blocks) sharded with ``FULL_SHARD`` runs one forward
and backward. Oracle: the block order of the model itself.

* One root: the model is an ``FSDPModule``, the only unit FSDP2 made a root at the first forward,
  and every unit shares its communication context (the streams that overlap all-gathers and
  reduce-scatters with compute). Separate roots each get their own streams, and a backward never
  prefetches across roots. The same when the sharded module's own forward never runs (a wrapper
  whose child is called directly, as a LightningModule's ``training_step`` may do).
* Forward prefetch: the all-gather of the next unit in block order (embedding, blocks, final norm,
  head), and of the next block's experts (the expert mesh), is issued before the current unit's
  forward has finished; backward prefetch: the all-gather of the previous unit (and of its experts)
  is issued before the current unit's reduce-scatter (the end of its backward).

What the CPU cannot show: whether the prefetched all-gathers overlap compute on a GPU (FSDP2's
all-gather stream against the compute stream). ``benchmarks/gpu_check.sh`` should profile one
``FULL_SHARD`` step on CUDA and check that each block's all-gather kernel runs while the previous
block computes, and that peak memory stays within two blocks' gathered parameters beyond the shards.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers.dist import run_distributed
from helpers.fsdp import record_collectives, root_states, states_of, unit_names
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.models.transformer import next_token_loss
from lightning_moe.parallel import ParallelDims, build_parallel_context, parallelize

pytestmark = pytest.mark.distributed

WORLD = 4
LAYERS = 4
SEQ = 8


def config() -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=LAYERS, num_attention_heads=4, num_kv_heads=2,
        ffn_hidden_size=64, first_dense_layers=1, max_seq_len=SEQ,
        moe=MoEConfig(32, 16, 8, top_k=2, score_func="sigmoid", load_balancing=["aux_loss"], aux_loss_coeff=1e-2),
    )


def chain() -> list[str]:
    """The units in the order their forward runs: embedding, blocks, final norm, head."""
    return ["embed", *(f"layers.{i}" for i in range(LAYERS)), "norm", "lm_head"]


def experts_of(unit: str) -> list[str]:
    """The expert unit inside ``unit`` (the MoE blocks'), on the expert mesh."""
    index = int(unit.split(".")[1]) if unit.startswith("layers.") else -1
    return [f"{unit}.ffn.experts"] if index >= config().first_dense_layers else []


def _step(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = MoETransformer(config())
    ctx = build_parallel_context(ParallelDims(world_size, ep=2, etp=1), "cpu")
    parallelize(model, ctx, sharding_strategy="FULL_SHARD")
    events: list = []
    for name in chain():  # after FSDP2's post-forward hook: the unit's forward (and reshard) is done
        model.get_submodule(name).register_forward_hook(lambda *_, n=name: events.append(("forward end", n)))
    tokens = torch.randint(0, 64, (2, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    with record_collectives(unit_names(model), events):
        loss = next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])
        events.append(("backward", ""))
        loss.backward()
    states = states_of([model])
    roots = root_states([model])
    meshes = {name: module._get_fsdp_state()._fsdp_param_groups[0].mesh_info.mesh.mesh_dim_names
              for name, module in model.named_modules()
              if isinstance(module, FSDPModule) and module._get_fsdp_state()._fsdp_param_groups}
    # A wrapper whose own forward never runs (a LightningModule whose training_step calls
    # self.model(x)): it is still the root, from the first forward of any unit inside it.
    torch.manual_seed(0)
    holder = nn.Module()
    holder.net = MoETransformer(config())
    parallelize(holder, ctx, sharding_strategy="FULL_SHARD")
    next_token_loss(holder.net(tokens[:, :-1]), tokens[:, 1:]).backward()
    holder_roots = root_states([holder])
    return {
        "holder root": isinstance(holder, FSDPModule) and [s is holder._get_fsdp_state() for s in holder_roots],
        "holder streams": len({id(state._comm_ctx) for state in states_of([holder])}),
        "events": events,
        "model is a unit": isinstance(model, FSDPModule),
        "roots": len(roots),
        "model is the root": bool(roots) and roots[0] is model._get_fsdp_state() if isinstance(model, FSDPModule) else False,
        "shared streams": len({id(state._comm_ctx) for state in states}),
        "meshes": meshes,
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_step, WORLD, timeout_s=180, tmp_dir=tmp_path_factory.mktemp("fsdp_root"))


def test_the_model_is_the_one_root(ranks):
    for rank, result in enumerate(ranks):
        assert result["model is a unit"], rank
        assert (result["roots"], result["model is the root"]) == (1, True), (rank, result["roots"])
        assert result["shared streams"] == 1, (rank, result["shared streams"])


def test_a_root_whose_forward_never_runs_still_drives_its_units(ranks):
    for rank, result in enumerate(ranks):
        assert result["holder root"] == [True], (rank, result["holder root"])
        assert result["holder streams"] == 1, (rank, result["holder streams"])


def test_experts_shard_on_the_expert_mesh_and_the_rest_on_the_dense_mesh(ranks):
    for result in ranks:
        for unit in chain():
            assert result["meshes"][unit] == ("dp",), unit
            for experts in experts_of(unit):
                assert result["meshes"][experts] == ("edp",), experts


def _index(events: list, event: tuple, start: int = 0, stop: int | None = None) -> int:
    stop = len(events) if stop is None else stop
    for i in range(start, stop):
        if events[i] == event:
            return i
    raise AssertionError(f"{event} not found in events[{start}:{stop}]: {events[start:stop]}")


def test_each_unit_prefetches_the_next_in_forward(ranks):
    order = chain()
    for rank, result in enumerate(ranks):
        events = result["events"]
        backward = _index(events, ("backward", ""))
        for current, following in itertools.pairwise(order):
            done = _index(events, ("forward end", current), stop=backward)
            for unit in (following, *experts_of(following)):
                assert _index(events, ("gather", unit), stop=backward) < done, (
                    f"rank {rank}: the all-gather of {unit} was issued after {current}'s forward ended"
                )


def test_each_unit_prefetches_the_previous_in_backward(ranks):
    order = chain()
    for rank, result in enumerate(ranks):
        events = result["events"]
        backward = _index(events, ("backward", ""))
        for previous, current in itertools.pairwise(order):
            done = _index(events, ("reduce", current), start=backward)
            for unit in (previous, *experts_of(previous)):
                assert _index(events, ("gather", unit), start=backward) < done, (
                    f"rank {rank}: the all-gather of {unit} was issued after {current}'s backward ended"
                )
