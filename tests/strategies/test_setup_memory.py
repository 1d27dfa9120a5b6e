"""Under ``MoEStrategy`` no rank ever holds the whole model, and ``Trainer.init_module(empty_init=True)`` works.

One launch of 2 gloo ranks (EP=2):

* ``MoELanguageModel`` is built on the meta device and only this rank's shard gets storage: every
  storage created from the callbacks' ``setup`` (before ``configure_model``) to ``on_fit_start``
  (after the strategy's setup) is counted (`helpers.live_bytes.LiveBytes`). Oracle: the bytes that
  stay (the module's shard) plus the largest tensor drawn in full (one expert's fc1, or a dense
  weight). The initial weights equal, bit for bit, a model built directly in one process from the
  same seed (experts from their global index).
* A user's module built under ``Trainer.init_module(empty_init=True)``, with torchmetrics states in
  ``__init__`` and the network in ``configure_model`` or in ``__init__``: validation runs and its
  metrics equal the one-process computation (the states keep their initial values; they cannot
  be re-drawn like weights). The same for ``MoELanguageModel``'s weights.

What the CPU cannot show: the device allocator; ``benchmarks/gpu_check.sh`` should compare
``torch.cuda.max_memory_allocated`` after setup with the rank's shard on a GPU.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from scale.formula import local_parameters
from strategies.toy import quiet_trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MaxMetric, MeanMetric, SumMetric

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models import MoETransformer, MoETransformerConfig
from lightning_moe.parallel import ParallelDims
from lightning_moe.planning.live_bytes import LiveBytes, held_bytes
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.distributed

WORLD = 2
SEED = 0
SAMPLES, SEQ, BATCH = 8, 8, 2
FP32 = 4  # initial values are drawn in fp32
LOSS_TOL = 1e-5  # fp32 losses at EP=2 against one process: the same products summed in another order


def _config() -> MoETransformerConfig:
    # Experts dominate (3 MoE layers of 8 experts), so a rank holding every expert shows.
    return MoETransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=4, num_attention_heads=4, ffn_hidden_size=64,
        first_dense_layers=1, max_seq_len=SEQ, moe=MoEConfig(32, 16, 8, top_k=2),
    )


def _largest_draw_bytes(config: MoETransformerConfig) -> int:
    """One expert's gated fc1 or the largest dense weight (embedding, head, dense MLP), in fp32."""
    moe = config.moe
    return FP32 * max(2 * moe.ffn_hidden_size * moe.hidden_size, config.vocab_size * config.hidden_size,
                      config.ffn_hidden_size * config.hidden_size)


def _data() -> DataLoader:
    tokens = torch.randint(0, 64, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)


def _full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The public state dict with expert DTensors gathered (a collective: same order on every rank)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in module.state_dict().items()}


def _direct_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    return dict(MoETransformer(_config()).state_dict())


class SetupMemory(L.Callback):
    """Counts the storages created between the callbacks' ``setup`` and ``on_fit_start``."""

    counter: LiveBytes | None = None

    def setup(self, trainer, pl_module, stage):
        self.counter = LiveBytes()
        self.counter.__enter__()

    def on_fit_start(self, trainer, pl_module):
        self.counter.__exit__(None, None, None)
        self.peak, self.live, self.held = self.counter.peak, self.counter.live, held_bytes(pl_module)
        self.param_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters())
        self.initial = {k.removeprefix("model."): v for k, v in _full_state(pl_module).items() if k.startswith("model.")}

    def on_exception(self, trainer, pl_module, exception):
        if self.counter is not None and not hasattr(self, "peak"):
            self.counter.__exit__(None, None, None)


def _fit_setup() -> dict:
    torch.manual_seed(SEED)
    module = MoELanguageModel(_config(), warmup_steps=1)
    memory = SetupMemory()
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=WORLD, strategy=MoEStrategy(expert_parallel_size=2), max_steps=1, callbacks=[memory],
    ))
    trainer.fit(module, _data())
    return {"peak": memory.peak, "live": memory.live, "held": memory.held, "initial": memory.initial,
            "param_bytes": memory.param_bytes}


class MetricLM(L.LightningModule):
    """A user's module: torchmetrics states in ``__init__``, the network there or in ``configure_model``."""

    def __init__(self, network_in_init: bool) -> None:
        super().__init__()
        self.loss_mean, self.loss_max, self.targets = MeanMetric(), MaxMetric(), SumMetric()
        self.net = None
        if network_in_init:
            torch.manual_seed(SEED)
            self.net = MoETransformer(_config())

    def configure_model(self) -> None:
        if self.net is None:
            torch.manual_seed(SEED)
            self.net = MoETransformer(_config())

    def validation_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = self.net.loss(inputs, targets)
        self.loss_mean.update(loss)
        self.loss_max.update(loss)
        self.targets.update(targets.numel())

    def on_validation_epoch_end(self) -> None:
        # compute() reduces over the ranks
        self.results = {"mean": self.loss_mean.compute().item(), "max": self.loss_max.compute().item(),
                        "targets": self.targets.compute().item()}


def _metrics_under_empty_init(network_in_init: bool) -> dict:
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=WORLD, strategy=MoEStrategy(expert_parallel_size=2)))
    with trainer.init_module(empty_init=True):
        module = MetricLM(network_in_init)
    try:
        trainer.validate(module, _data(), verbose=False)
    except Exception as error:  # reported by the test (both ranks fail alike: no collective is left waiting)
        return {"error": f"{type(error).__name__}: {error}"}
    return module.results


def _empty_init() -> dict:
    out = {
        f"metrics, network in {'__init__' if in_init else 'configure_model'}": _metrics_under_empty_init(in_init)
        for in_init in (False, True)
    }
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=WORLD, strategy=MoEStrategy(expert_parallel_size=2)))
    torch.manual_seed(SEED)
    with trainer.init_module(empty_init=True):
        module = MoELanguageModel(_config())
    trainer.validate(module, _data(), verbose=False)
    out["MoELanguageModel weights"] = {k.removeprefix("model."): v for k, v in _full_state(module).items()
                                       if k.startswith("model.")}
    return out


def _launch(rank: int, world: int) -> dict:
    return {"fit": _fit_setup(), "empty_init": _empty_init()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_launch, WORLD, timeout_s=240, tmp_dir=tmp_path_factory.mktemp("setup_memory"))


def test_setup_allocates_the_shard_and_at_most_one_tensor_beside_it(ranks):
    draw = _largest_draw_bytes(_config())
    moe = _config().moe
    all_experts = FP32 * 3 * moe.num_experts * 3 * moe.ffn_hidden_size * moe.hidden_size  # 3 MoE layers
    assert draw < all_experts / WORLD  # the check tells a rank holding every expert from one holding its half
    shard = FP32 * local_parameters(_config(), ParallelDims(WORLD, ep=2))  # the oracle: the layout's arithmetic
    for rank, result in enumerate(ranks):
        peak, live, held = result["fit"]["peak"], result["fit"]["live"], result["fit"]["held"]
        assert result["fit"]["param_bytes"] == shard, (rank, result["fit"]["param_bytes"], shard)
        assert held <= live < held + draw, (rank, live, held)  # what stays is the module's shard (and a few scalars)
        assert peak <= live + draw, (
            f"rank {rank}: setup peak {peak} bytes is the {live} bytes that stay plus {peak - live}; at most the "
            f"largest drawn tensor ({draw} bytes) may be added (all experts: {all_experts} bytes)"
        )


def test_initial_weights_equal_one_process(ranks):
    direct = _direct_state()
    for rank, result in enumerate(ranks):
        for source in (result["fit"]["initial"], result["empty_init"]["MoELanguageModel weights"]):
            assert source.keys() == direct.keys()
            for key, value in direct.items():
                assert torch.equal(source[key], value), (rank, key)


def _one_process_metrics() -> dict:
    """What the ranks' validation computes: each rank's DistributedSampler shard (every WORLD-th
    sample), batches of BATCH, on the one-device network; torchmetrics reduces over the ranks."""
    torch.manual_seed(SEED)
    net = MoETransformer(_config())
    inputs, targets = _data().dataset.tensors
    losses = []
    with torch.no_grad():
        for rank in range(WORLD):
            shard = torch.arange(rank, SAMPLES, WORLD)
            for batch in shard.split(BATCH):
                losses.append(net.loss(inputs[batch], targets[batch]).item())
    return {"mean": sum(losses) / len(losses), "max": max(losses), "targets": float(targets.numel())}


def test_empty_init_keeps_metric_states(ranks):
    want = _one_process_metrics()
    for rank, result in enumerate(ranks):
        for case in ("metrics, network in configure_model", "metrics, network in __init__"):
            got = result["empty_init"][case]
            assert "error" not in got, (rank, case, got)
            assert got["targets"] == want["targets"], (rank, case, got)
            assert got["mean"] == pytest.approx(want["mean"], rel=LOSS_TOL, abs=0), (rank, case, got)
            assert got["max"] == pytest.approx(want["max"], rel=LOSS_TOL, abs=0), (rank, case, got)
