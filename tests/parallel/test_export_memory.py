"""``lightning-moe export`` holds one tensor at a time, not the model, and writes sharded safetensors.

A four-layer reference model (``MoELanguageModel``, byte vocabulary, 8 experts) is saved as a
sharded DCP checkpoint (as ``MoEStrategy`` writes, one process here) and as a consolidated file.
:class:`helpers.memory.HeldBytes` measures the peak bytes of tensor storages the export holds.
Bound: ``2 T``, ``T`` the largest tensor of the state dict: the tensor being read and one chunk
DCP deserialises into it (a consolidated file is memory-mapped: its page cache is not counted);
the whole model is more than ``6 T``. ``--format hf`` with a small ``max_shard_size`` writes
several ``model-0000i-of-0000N.safetensors`` shards and ``model.safetensors.index.json``, and its
bound is the same ``2 T``: each shard is written tensor by tensor, never held whole.

Oracles: the exported file loads with ``torch.load(weights_only=True)`` and ``strict=True`` into
the single-device model, equal to the saved weights; the Hugging Face directory reads back through
the ``safetensors`` library (index and shard sizes checked against the files) and through
``MoETransformer.from_pretrained`` (the same weights, exactly). ``tests/test_cli_export.py`` loads
sharded exports of trained checkpoints in ``transformers``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.memory import HeldBytes

from lightning_moe import MoEConfig
from lightning_moe.checkpoint.export import export_checkpoint
from lightning_moe.checkpoint.export_hf import MODEL_CONFIG_KEY, export_hf, model_record
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models import MoETransformer, MoETransformerConfig

pytest.importorskip("safetensors", reason="the hf and test extras install safetensors")

# dcp.save in one process, and checkpoints written here without checksums.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

def _config() -> MoETransformerConfig:
    return MoETransformerConfig(
        vocab_size=320, hidden_size=64, num_layers=4, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=128,
        max_seq_len=64, moe=MoEConfig(hidden_size=64, ffn_hidden_size=64, num_experts=8, top_k=2),
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """The model's state dict, and the same checkpoint sharded and consolidated."""
    root = tmp_path_factory.mktemp("export_memory")
    torch.manual_seed(0)
    module = MoELanguageModel(_config())
    module.configure_model()
    state = {key: value.detach().clone() for key, value in module.state_dict().items()}
    record = {MODEL_CONFIG_KEY: model_record(_config(), None, None)}
    sharded = root / "sharded.ckpt"
    dcp.save({"state_dict": state}, checkpoint_id=sharded, no_dist=True)
    torch.save({"epoch": 0, **record}, sharded / "meta.pt")
    consolidated = root / "consolidated.ckpt"
    torch.save({"state_dict": state, "epoch": 0, **record}, consolidated)
    return {"state": state, "sharded": sharded, "consolidated": consolidated}


def _largest(state: dict) -> int:
    return max(t.numel() * t.element_size() for t in state.values())


@pytest.mark.parametrize("kind", ["sharded", "consolidated"])
def test_export_holds_at_most_two_tensors(saved, kind, tmp_path):
    largest, whole = _largest(saved["state"]), sum(t.numel() * t.element_size() for t in saved["state"].values())
    assert whole > 6 * largest
    with HeldBytes() as held:
        export_checkpoint(saved[kind], tmp_path / "weights.pt", verify=False)
    assert held.peak <= 2 * largest, f"held {held.peak} bytes; at most {2 * largest} (whole model {whole})"
    exported = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert list(exported) == list(saved["state"])
    for key, value in saved["state"].items():
        assert type(exported[key]) is torch.Tensor and torch.equal(exported[key], value), key
    target = MoELanguageModel(_config())
    target.configure_model()
    target.load_state_dict(exported, strict=True)


def test_export_hf_writes_indexed_shards_one_tensor_at_a_time(saved, tmp_path):
    from safetensors import safe_open

    largest = _largest(saved["state"])
    max_shard = 3 * largest  # several tensors per shard, several shards
    out = tmp_path / "hf"
    with HeldBytes() as held:
        summary = export_hf(saved["sharded"], out, verify=False, max_shard_size=max_shard)
    assert held.peak <= 2 * largest, f"held {held.peak} bytes; at most {2 * largest}"

    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert sorted(p.name for p in out.glob("*.safetensors")) == files and not (out / "model.safetensors").exists()
    total = 0
    for name in files:
        with safe_open(out / name, framework="pt") as shard:
            keys = list(shard.keys())
            sizes = [shard.get_tensor(k).numel() * shard.get_tensor(k).element_size() for k in keys]
        assert sorted(keys) == sorted(k for k, f in index["weight_map"].items() if f == name)
        assert sum(sizes) <= max_shard or len(keys) == 1, f"{name}: {sum(sizes)} bytes > {max_shard}"
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total == summary.num_bytes

    reloaded = MoETransformer.from_pretrained(out)
    model_state = {k[len("model."):]: v for k, v in saved["state"].items() if k.startswith("model.")}
    assert sorted(reloaded.state_dict()) == sorted(model_state)
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, model_state[key]), key
