"""Checkpoints of a LoRA run hold the adapters, their optimizer state and the base's identity, and resume
at another layout as if the run had not stopped.

Oracle: the same run uninterrupted. A tiny Qwen3-MoE directory is the base (``init_from``); on 4
gloo ranks LoRA trains 4 AdamW steps at EP=2 (2 micro-batches per step, clipping), and separately
2 steps at EP=2 whose checkpoint (written by ``ModelCheckpoint``, the sharded directory) is then
resumed for steps 3 and 4 at ETP=2 x EP=2, the base read from ``init_from`` again. The resumed
losses and final adapters must equal the uninterrupted ones (fp32, as ``test_lora_layouts``:
AdamW ``eps=1e-2``). The checkpoint's tensors must be exactly the adapters and their Adam state,
its files their size plus DCP's framing, far less than the base; ``meta.pt`` records
``init_from`` and the base's fingerprint, and resuming on a base drawn from another seed is refused.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from helpers.asserts import assert_close_to_scale
from helpers.dist import run_distributed
from helpers.hf import tiny_models
from strategies.toy import quiet_trainer_kwargs
from torch.distributed.checkpoint import FileSystemReader
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe.cli import export_main
from lightning_moe.lit import MoELanguageModel
from lightning_moe.lora import LoRAConfig, apply_lora, is_adapter_key
from lightning_moe.lora.checkpoint import LORA_RECORD_KEY
from lightning_moe.models import MoETransformer
from lightning_moe.strategies import MoEStrategy

pytest.importorskip("transformers", reason="the test extra installs transformers")
pytest.importorskip("safetensors", reason="the hf and test extras install safetensors")

pytestmark = pytest.mark.distributed

WORLD, SEQ, GLOBAL_BATCH, ACCUMULATE, STEPS, FIRST = 4, 8, 4, 2, 4, 2
STEPS_PER_EPOCH = 2  # the checkpoint after FIRST steps is at an epoch's end: resuming replays no batch
NUM_SAMPLES = GLOBAL_BATCH * ACCUMULATE * STEPS_PER_EPOCH
LR, CLIP, ADAM_EPS = 1e-2, 0.05, 1e-2  # eps: see tests/lora/test_lora_layouts.py
TOL = 1e-5
LORA = LoRAConfig(rank=4, alpha=8.0, targets=["experts", "q_proj", "v_proj", "o_proj"])
FIRST_LAYOUT = {"expert_parallel_size": 2}
RESUME_LAYOUT = {"expert_parallel_size": 2, "expert_tensor_parallel_size": 2}


class _Recording(MoELanguageModel):
    """Records each micro-batch's local loss; AdamW with ``ADAM_EPS``."""

    losses: list

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        config = super().configure_optimizers()
        for group in config["optimizer"].param_groups:
            group["eps"] = ADAM_EPS
        return config


def _dataset(vocab: int) -> TensorDataset:
    tokens = torch.randint(0, vocab, (NUM_SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _fit(base, layout, max_steps, ckpt_path=None, callbacks=()) -> dict:
    torch.manual_seed(0)
    # min_lr_ratio=1: a constant rate after warm-up, so the first run's schedule is the uninterrupted one's.
    module = _Recording(init_from=str(base), learning_rate=LR, warmup_steps=1, min_lr_ratio=1.0, lora=LORA)
    module.losses = []
    trainer = L.Trainer(**quiet_trainer_kwargs(
        devices=WORLD, strategy=MoEStrategy(**layout),
        max_steps=max_steps, accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP,
        enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
    ))
    trainer.fit(module, DataLoader(_dataset(module.config.vocab_size), batch_size=GLOBAL_BATCH // WORLD),
                ckpt_path=ckpt_path)
    state = module.model.state_dict()
    adapters = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in state.items() if is_adapter_key(k)}
    return {"losses": module.losses, "adapters": adapters}


def _runs(rank: int, world: int, base, other_base, ckpt_dir) -> dict:
    whole = _fit(base, FIRST_LAYOUT, STEPS)
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=FIRST, save_top_k=-1)
    first = _fit(base, FIRST_LAYOUT, FIRST, callbacks=[checkpoint])
    path = ckpt_dir / f"epoch=0-step={FIRST}.ckpt"
    resumed = _fit(base, RESUME_LAYOUT, STEPS, ckpt_path=path)
    try:
        _fit(other_base, RESUME_LAYOUT, STEPS, ckpt_path=path)
        refusal = None
    except ValueError as err:
        refusal = str(err)
    return {"whole": whole, "first": first, "resumed": resumed, "refusal": refusal, "path": path}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_ckpt")
    tiny = tiny_models()
    base, other = tmp / "base", tmp / "other"
    tiny.tiny_model("qwen3_moe", seed=0).save_pretrained(base)
    tiny.tiny_model("qwen3_moe", seed=1).save_pretrained(other)
    ranks = run_distributed(_runs, WORLD, base, other, tmp / "ckpt", timeout_s=400, tmp_dir=tmp)
    return ranks, base


def test_resumed_at_another_layout_equals_the_uninterrupted_run(runs):
    ranks, _ = runs
    for r in ranks:
        assert len(r["resumed"]["losses"]) == (STEPS - FIRST) * ACCUMULATE
    whole = torch.tensor([r["whole"]["losses"][FIRST * ACCUMULATE:] for r in ranks], dtype=torch.float64).mean(0)
    resumed = torch.tensor([r["resumed"]["losses"] for r in ranks], dtype=torch.float64).mean(0)
    torch.testing.assert_close(resumed, whole, rtol=TOL, atol=TOL)
    want = ranks[0]["whole"]["adapters"]
    assert want and any(v.abs().max() > 0 for k, v in want.items() if k.endswith("lora_B"))
    for r in ranks:
        assert r["resumed"]["adapters"].keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(r["resumed"]["adapters"][name], value, rtol=TOL, atol=TOL,
                                       msg=lambda m, n=name: f"{n}: {m}")


def test_checkpoint_holds_adapters_optimizer_state_and_base_identity(runs):
    ranks, base = runs
    path = ranks[0]["path"]
    adapters = ranks[0]["whole"]["adapters"]
    adapter_bytes = sum(v.numel() * v.element_size() for v in adapters.values())
    metadata = FileSystemReader(str(path)).read_metadata()
    entries = {k: v for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}
    want_keys = {f"state_dict.model.{k}" for k in adapters}
    want_keys |= {f"optimizer_0.model.{k}.{s}" for k in adapters for s in ("step", "exp_avg", "exp_avg_sq")}
    assert set(entries) == want_keys, sorted(set(entries) ^ want_keys)[:8]
    logical = sum(math.prod(v.size) * v.properties.dtype.itemsize for v in entries.values())
    assert logical == 3 * adapter_bytes + 4 * len(adapters)  # the adapters, Adam's two moments, one fp32 step each
    # On disk each stored piece (a tensor, or a rank's shard of one) is a torch.save record: its bytes
    # plus framing (about 1.5 KiB).
    stored = metadata.storage_data.values()
    shard_bytes = sum(f.stat().st_size for f in path.glob("*.distcp"))
    assert logical <= shard_bytes <= logical + 2048 * len(stored), (shard_bytes, logical, len(stored))
    base_bytes = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    assert logical < base_bytes  # a checkpoint with the base would hold more than the base alone
    meta = torch.load(path / "meta.pt", weights_only=True)
    assert all(is_adapter_key(k) for k in meta.get("state_dict", {}))
    record = meta[LORA_RECORD_KEY]
    assert record["init_from"] == str(base)
    assert record["config"]["rank"] == LORA.rank
    assert record["base_fingerprint"] and not any(is_adapter_key(k) for k in record["base_fingerprint"])


def test_resuming_on_another_base_is_refused(runs):
    ranks, _ = runs
    for r in ranks:
        assert r["refusal"] is not None and "trained on another base" in r["refusal"], r["refusal"]


def _lora_logits(base, adapters: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Oracle of the merged export: the base with the checkpoint's adapters applied, one process."""
    model = MoETransformer.from_pretrained(base)
    apply_lora(model, LORA)
    model.load_state_dict(adapters, strict=False)
    with torch.no_grad():
        return model(tokens)


def test_export_merge_folds_the_adapters_into_the_base(runs, tmp_path):
    import transformers

    ranks, base = runs
    tokens = torch.randint(0, 320, (2, SEQ), generator=torch.Generator().manual_seed(7))
    want = _lora_logits(base, ranks[0]["first"]["adapters"], tokens)
    export_main([str(ranks[0]["path"]), str(tmp_path / "merged.pt"), "--merge"])
    state = torch.load(tmp_path / "merged.pt", weights_only=True)
    assert not any(is_adapter_key(k) for k in state)
    plain = MoETransformer.from_pretrained(base)  # the plain model's keys; every weight replaced by the export's
    plain.load_state_dict({k[len("model."):]: v for k, v in state.items()}, strict=True)
    with torch.no_grad():
        assert_close_to_scale(plain(tokens), want, TOL, "merged torch export")
    export_main([str(ranks[0]["path"]), str(tmp_path / "merged_hf"), "--merge", "--format", "hf"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged_hf").eval()
    with torch.no_grad():
        assert_close_to_scale(hf(tokens).logits, want, TOL, "merged hf export")


def test_export_adapter_writes_what_peft_applies_to_the_base(runs, tmp_path):
    import transformers

    peft = pytest.importorskip("peft", reason="the test extra installs peft")
    ranks, base = runs
    tokens = torch.randint(0, 320, (2, SEQ), generator=torch.Generator().manual_seed(7))
    want = _lora_logits(base, ranks[0]["first"]["adapters"], tokens)
    export_main([str(ranks[0]["path"]), str(tmp_path / "adapter"), "--adapter"])  # the EP=2 sharded checkpoint
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(input_ids=tokens).logits
    assert_close_to_scale(got, want, TOL, "the PEFT adapter on the transformers base")
    with pytest.raises(SystemExit):
        export_main([str(ranks[0]["path"]), str(tmp_path / "both"), "--adapter", "--merge"])
