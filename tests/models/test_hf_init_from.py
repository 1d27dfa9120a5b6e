"""``MoELanguageModel(init_from=path)``: training starts from a Hugging Face directory's weights.

Oracle: ``transformers``' own model of the directory (written by ``examples/make_tiny_hf_model.py``,
a tiny Qwen3-MoE with a dense layer). The loss of the first training step on each rank must equal
the cross-entropy of ``transformers``' logits on that rank's batch (fp32, 1e-5 relative), on one
device without a strategy and on 4 gloo ranks with ``MoEStrategy`` at EP=2 and at TP=2 x EP=4
folded (ETP=1), each also with ``FULL_SHARD``. Under the strategy the transformer is built on the
meta device (no rank ever holds the whole model). Resuming from a checkpoint (``ckpt_path``) keeps
the checkpoint's weights and reads nothing from the directory (its weights are removed first).
After the step, each layout's sharded checkpoint exported with ``export_hf`` (``lightning-moe export
--format hf``) loads in ``transformers`` as the same family and gives the trained model's logits.
Tiny Qwen2-MoE and GLM-4.5 directories give ``transformers``' first-step loss on one device too.
"""

from __future__ import annotations

import shutil

import lightning as L
import pytest
import torch
from helpers.dist import run_distributed
from helpers.hf import tiny_models
from strategies.toy import quiet_trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe.lit import MoELanguageModel
from lightning_moe.models import MoETransformer
from lightning_moe.models.transformer import next_token_loss

pytest.importorskip("transformers", reason="the test extra installs transformers")
pytest.importorskip("safetensors", reason="the hf and test extras install safetensors")

WORLD, SEQ, LOCAL_BATCH = 4, 16, 2
LOSS_RTOL = 1e-5
LAYOUTS = {"ep2": (1, 2, 1), "tp2-ep4-etp1": (2, 4, 1)}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """(directory, transformers model)."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    model = tiny_models().make_tiny_model(path, "qwen3_moe", texts=["def f(x):\n    return x\n"] * 4)
    return path, model


def dataset() -> TensorDataset:
    tokens = torch.randint(3, 320, (WORLD * LOCAL_BATCH * 2, SEQ + 1), generator=torch.Generator().manual_seed(11))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class Recording(MoELanguageModel):
    """Records whether the transformer was built on meta, and the first step's batch and loss."""

    built_on_meta: bool | None = None
    first: dict | None = None

    def configure_model(self) -> None:
        first_build = self.model is None
        super().configure_model()
        if first_build:
            self.built_on_meta = all(p.is_meta for p in self.model.parameters())

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.first is None:
            self.first = {"inputs": batch[0].clone(), "targets": batch[1].clone(), "loss": loss.detach().clone()}
        return loss


def hf_logits(hf_model) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(input_ids=probe_tokens()).logits


def hf_loss(hf_model, inputs, targets) -> torch.Tensor:
    with torch.no_grad():
        return next_token_loss(hf_model(input_ids=inputs).logits, targets)


def probe_tokens() -> torch.Tensor:
    return torch.randint(3, 320, (2, SEQ), generator=torch.Generator().manual_seed(12))


def _fit(rank: int, world_size: int, path: str, layout, sharding: str, checkpoint: str) -> dict:
    from torch.distributed.tensor import DTensor

    from lightning_moe.strategies import MoEStrategy

    tp, ep, etp = layout
    module = Recording(init_from=path, learning_rate=1e-3, warmup_steps=0)
    strategy = MoEStrategy(
        tensor_parallel_size=tp, expert_parallel_size=ep, expert_tensor_parallel_size=etp, sharding_strategy=sharding
    )
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=world_size, strategy=strategy, max_steps=1), limit_val_batches=0)
    trainer.fit(module, DataLoader(dataset(), batch_size=LOCAL_BATCH))
    trainer.save_checkpoint(checkpoint)  # every rank writes its shards
    with torch.no_grad():
        model = module.model.eval()
        logits = model.full_logits(model(probe_tokens()))  # each TP rank's output is its vocabulary slice
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return {"built_on_meta": module.built_on_meta, "logits": logits, **module.first}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["NO_SHARD", "FULL_SHARD"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_first_step_loss_equals_transformers_at_scale(hf_dir, layout, sharding, tmp_path):
    import transformers

    from lightning_moe.checkpoint.export_hf import export_hf

    path, hf_model = hf_dir
    checkpoint = tmp_path / "trained.ckpt"
    results = run_distributed(
        _fit, WORLD, str(path), LAYOUTS[layout], sharding, str(checkpoint), tmp_dir=tmp_path, timeout_s=240
    )
    for rank, result in enumerate(results):
        assert result["built_on_meta"] is True, rank
        expected = hf_loss(hf_model, result["inputs"], result["targets"])
        torch.testing.assert_close(result["loss"], expected, rtol=LOSS_RTOL, atol=0.0, msg=f"rank {rank}")
    # The one step's checkpoint, at this layout, exported as a Hugging Face directory of the same family.
    export_hf(checkpoint, tmp_path / "exported")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    assert type(exported) is type(hf_model)
    with torch.no_grad():
        logits = exported(input_ids=probe_tokens()).logits
    for rank, result in enumerate(results):
        scale = result["logits"].abs().max().item()
        torch.testing.assert_close(logits, result["logits"], rtol=0.0, atol=1e-5 * scale, msg=f"rank {rank}")
    assert not torch.equal(logits, hf_logits(hf_model)), "the exported model is the trained one, not the start"


def test_one_device_first_step_and_resume_keeps_the_checkpoint(hf_dir, tmp_path):
    source, hf_model = hf_dir
    path = tmp_path / "hf"
    shutil.copytree(source, path)
    module = Recording(init_from=str(path), learning_rate=1e-2, warmup_steps=0)
    assert module.config == MoETransformer.from_pretrained(path).config
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=1, max_steps=2, enable_checkpointing=True,
                                               default_root_dir=tmp_path), limit_val_batches=0)
    trainer.fit(module, DataLoader(dataset(), batch_size=LOCAL_BATCH))
    assert module.built_on_meta is False
    first = module.first
    torch.testing.assert_close(first["loss"], hf_loss(hf_model, first["inputs"], first["targets"]), rtol=LOSS_RTOL, atol=0.0)
    checkpoint = trainer.checkpoint_callback.last_model_path or trainer.checkpoint_callback.best_model_path
    trained = {k: v.clone() for k, v in module.model.state_dict().items()}

    for weights in path.glob("*.safetensors"):
        weights.unlink()  # resuming must not read them
    resumed = Recording(init_from=str(path), learning_rate=1e-2, warmup_steps=0)
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=1, max_steps=3), limit_val_batches=0)
    trainer.fit(resumed, DataLoader(dataset(), batch_size=LOCAL_BATCH), ckpt_path=checkpoint)
    # The step resumed from the checkpoint's weights: its loss is the trained model's, not the directory's.
    reference = MoETransformer(module.config)
    reference.load_state_dict(trained)
    with torch.no_grad():
        expected = reference.eval().loss(resumed.first["inputs"], resumed.first["targets"])
    torch.testing.assert_close(resumed.first["loss"], expected, rtol=LOSS_RTOL, atol=0.0)


@pytest.mark.parametrize("family", ["qwen2_moe", "glm4_moe"])
def test_one_device_first_step_of_the_other_families(family, tmp_path):
    # Qwen2-MoE (q/k/v biases, gated shared expert) and GLM-4.5 (partial rotary, q/k norm, biases);
    # their sharded loading is tests/parallel/test_hf_load.py's.
    hf_model = tiny_models().make_tiny_model(tmp_path / family, family, texts=["def f(x):\n    return x\n"] * 4)
    module = Recording(init_from=str(tmp_path / family), learning_rate=1e-2, warmup_steps=0)
    trainer = L.Trainer(**quiet_trainer_kwargs(devices=1, max_steps=1), limit_val_batches=0)
    trainer.fit(module, DataLoader(dataset(), batch_size=LOCAL_BATCH))
    first = module.first
    torch.testing.assert_close(first["loss"], hf_loss(hf_model, first["inputs"], first["targets"]), rtol=LOSS_RTOL, atol=0.0)


def test_model_and_init_from_are_exclusive(hf_dir):
    path, _ = hf_dir
    config = MoETransformer.from_pretrained(path).config
    with pytest.raises(ValueError, match="both model and init_from"):
        MoELanguageModel(config, init_from=str(path))
    with pytest.raises(ValueError, match=r"needs model .* or init_from"):
        MoELanguageModel()
    module = MoELanguageModel(init_from=str(path), model_overrides={"max_seq_len": 32, "moe": {"aux_loss_coeff": 0.5}})
    assert module.config.max_seq_len == 32 and module.config.moe.aux_loss_coeff == 0.5
    assert module.hparams.init_from == str(path) and module.hparams.model is None
