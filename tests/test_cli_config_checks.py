"""Configuration mistakes found before any process starts (:mod:`lightning_moe.cli_checks`), in-process.

Oracles: the rule each check stands for, taken from the code that would fail later (a brute-force
search over sequence lengths that context parallelism's chunking and sequence parallelism's
slicing accept; ``TextDataModule.setup``'s own error for a corpus it cannot split); the fields of
the configuration dataclasses. The "before any rank starts" path through the console script is
one case of ``test_cli_layout_errors.py`` (batch vs ``num_microbatches``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lightning_moe import MoEConfig
from lightning_moe.cli import cli_main, main
from lightning_moe.cli_checks import config_problems, init_from_problems, sequence_multiple
from lightning_moe.lit import MoELanguageModel, TextDataModule
from lightning_moe.models import MoETransformerConfig
from lightning_moe.parallel.config_error import ConfigError
from lightning_moe.parallel.context_parallel import load_balanced_positions
from lightning_moe.strategies import MoEStrategy

pytestmark = pytest.mark.filterwarnings(r"ignore:(?s).*(deprecated in v4\.49\.0|JSONARGPARSE_DEPRECATION_WARNINGS)")


@pytest.fixture(scope="module")
def model() -> MoELanguageModel:
    config = MoETransformerConfig(
        vocab_size=320, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
        max_seq_len=64, moe=MoEConfig(32, 16, 4, top_k=2),
    )
    return MoELanguageModel(config)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i in range(4):
        (root / f"doc{i}.txt").write_text(f"document {i}\n" * 20)
    return root


def _data(source, **kwargs) -> TextDataModule:
    return TextDataModule(str(source), **{"seq_len": 16, "batch_size": 8, **kwargs})


def test_a_valid_configuration_has_no_problem(model, corpus):
    strategy = MoEStrategy(pipeline_parallel_size=2, num_microbatches=4, context_parallel_size=2, tensor_parallel_size=2)
    assert config_problems(model, _data(corpus), strategy) == []


def test_batch_size_must_split_into_the_pipeline_micro_batches(model, corpus):
    (problem,) = config_problems(model, _data(corpus), MoEStrategy(pipeline_parallel_size=2, num_microbatches=3))
    assert "data.batch_size=8 does not split into num_microbatches=3 equal micro-batches" in problem


@pytest.mark.parametrize("subcommand", ["test", "predict"])
def test_test_and_predict_are_refused_under_pipeline_parallelism(model, corpus, subcommand):
    strategy = MoEStrategy(pipeline_parallel_size=2, num_microbatches=2)
    assert config_problems(model, _data(corpus), strategy, "fit") == []
    (problem,) = config_problems(model, _data(corpus), strategy, subcommand)
    assert problem.startswith(f"pipeline_parallel_size=2 does not support Trainer.{subcommand} (only fit and validate")
    assert f"run {subcommand} with pipeline_parallel_size=1" in problem


def _accepted(seq: int, cp: int, tp: int) -> bool:
    """What the parallel code accepts: CP's 2 x CP chunks, then TP equal slices of each rank's tokens."""
    if cp > 1:
        try:
            load_balanced_positions(seq, 0, cp)
        except ValueError:
            return False
    return (seq // cp) % tp == 0


@pytest.mark.parametrize(("cp", "tp"), [(1, 1), (1, 2), (2, 1), (2, 2), (2, 3), (4, 2), (3, 4)])
def test_sequence_multiple_is_the_smallest_length_context_and_sequence_parallelism_accept(cp, tp):
    accepted = [seq for seq in range(1, 200) if _accepted(seq, cp, tp)]
    multiple = sequence_multiple(cp, tp)
    assert accepted == list(range(multiple, 200, multiple))


def test_seq_len_is_checked_against_cp_tp_and_max_seq_len(model, corpus):
    strategy = MoEStrategy(context_parallel_size=2, tensor_parallel_size=2)
    (problem,) = config_problems(model, _data(corpus, seq_len=18), strategy)
    assert "data.seq_len=18 is not a multiple of 4: with context_parallel_size=2" in problem
    (problem,) = config_problems(model, _data(corpus, seq_len=128), MoEStrategy())
    assert "data.seq_len=128 exceeds the model's max_seq_len=64" in problem


@pytest.mark.parametrize(("texts", "refused"), [
    (["x"], True),  # one document of one character: nothing to cut in two
    (["document\n" * 40], False),  # one document: cut at a line boundary
    (["document\n" * 40] * 4, False),  # split by document
], ids=["one-character", "one-document", "four-documents"])
def test_val_fraction_is_checked_with_the_data_modules_own_split(model, tmp_path, texts, refused):
    for i, text in enumerate(texts):
        (tmp_path / f"doc{i}.txt").write_text(text)
    data = _data(tmp_path, val_fraction=0.5)
    try:  # the oracle: what the data module itself says when it reads the corpus
        data.setup("fit")
        expected = None
    except ValueError as err:
        expected = str(err)
    assert (expected is not None) == refused, expected
    problems = config_problems(model, _data(tmp_path, val_fraction=0.5), MoEStrategy())
    if expected is None:
        assert problems == []
    else:
        (problem,) = problems
        assert problem.startswith(f"data.source={str(tmp_path)!r}, data.val_fraction=0.5: ") and expected in problem


def test_a_tokenizer_larger_than_the_model_vocabulary_is_a_problem(corpus):
    small = MoELanguageModel(MoETransformerConfig(
        vocab_size=256, hidden_size=32, num_layers=1, num_attention_heads=4, ffn_hidden_size=64, max_seq_len=64,
    ))
    data = _data(corpus)  # the byte tokenizer: 259 ids
    (problem,) = config_problems(small, data, MoEStrategy())
    assert problem == (
        f"The tokenizer emits {data.vocab_size} token ids but model.vocab_size=256; set model.vocab_size >= "
        f"{data.vocab_size} (a multiple of 64 keeps tensor parallelism happy)."
    )


def test_a_missing_source_is_a_problem(model, tmp_path):
    (problem,) = config_problems(model, _data(tmp_path / "missing"), MoEStrategy())
    assert "does not exist" in problem


def test_init_from_family_and_override_keys(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (problem,) = init_from_problems(str(tmp_path), {})
    assert problem.startswith(f"model.init_from={str(tmp_path)!r}: model_type 'llama' is not supported; supported")
    problems = init_from_problems(str(tmp_path), {"max_seq_len": 64, "hidden": 8, "moe": {"top_k": 2, "topk": 1}})
    assert problems[0].startswith("model.model_overrides has key(s) ['hidden'] that are not MoETransformerConfig fields")
    assert problems[1].startswith("model.model_overrides.moe has key(s) ['topk'] that are not MoEConfig fields")
    (problem,) = init_from_problems(str(tmp_path / "nowhere"), None)
    assert problem.startswith(f"model.init_from={str(tmp_path / 'nowhere')!r}: ")


def test_the_cli_refuses_an_unsupported_init_from_before_building_the_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match=r"The configuration cannot run: model.init_from=.*model_type 'llama'"):
        cli_main(["fit", f"--model.init_from={tmp_path}", "--trainer.accelerator=cpu", "--trainer.devices=1",
                  "--trainer.logger=false"])


@pytest.mark.parametrize("rank", [0, 1])
def test_a_configuration_error_is_printed_once_by_rank_zero(rank, monkeypatch, capsys):
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    def fail(*args, **kwargs):
        raise ConfigError("pipeline_parallel_size > 1 does not support: Trainer.test (...).")

    monkeypatch.setattr("lightning_moe.cli.cli_main", fail)
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    expected = "lightning-moe: error: pipeline_parallel_size > 1 does not support: Trainer.test (...).\n"
    assert err == (expected if rank == 0 else "")


def test_the_reference_config_passes():
    # The example a newcomer runs first must pass the checks it will meet.
    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "examples/configs/tiny_cpu.yaml").read_text())
    fields = config["model"]["model"]
    reference = MoELanguageModel(MoETransformerConfig(**{**fields, "moe": MoEConfig(**fields["moe"])}))
    strategy = MoEStrategy(**config["trainer"]["strategy"]["init_args"])
    data = TextDataModule(**config["data"])
    assert config_problems(reference, data, strategy) == []


def test_1f1b_needs_at_least_as_many_micro_batches_as_stages(model, corpus):
    # torch's Schedule1F1B raises "Number of microbatches (1) must be greater than or equal to the number of
    # stages (2)" at the first training step, after every rank started; GPipe has no such rule.
    (problem,) = config_problems(model, _data(corpus), MoEStrategy(pipeline_parallel_size=2))
    assert "num_microbatches=1 < pipeline_parallel_size=2" in problem and "num_microbatches=2" in problem
    assert config_problems(model, _data(corpus), MoEStrategy(pipeline_parallel_size=2, num_microbatches=2)) == []
    assert config_problems(model, _data(corpus), MoEStrategy(pipeline_parallel_size=2, pipeline_schedule="GPipe")) == []
