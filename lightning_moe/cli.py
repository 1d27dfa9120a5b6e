"""``lightning-moe``: train any LightningModule with MoE layers from a YAML file, export its weights.

    lightning-moe fit --config examples/configs/tiny_cpu.yaml
    lightning-moe fit --config examples/configs/tiny_cpu.yaml --trainer.logger.init_args.version=0 --ckpt_path last
    lightning-moe fit --help                                   # every Trainer option
    lightning-moe fit --model.help MoELanguageModel            # the reference model's options
    lightning-moe fit --model.help MoELanguageModel --model.model.moe.help   # its MoE layers' options
    lightning-moe export CKPT OUT                              # a checkpoint's weights as one file
    lightning-moe export CKPT OUT_DIR --format hf              # ... as a Hugging Face model directory
    lightning-moe export LORA_CKPT OUT --merge [--format hf]   # a LoRA run's base with its adapters folded in
    lightning-moe export LORA_CKPT OUT --adapter               # a LoRA run's adapters as a PEFT directory
    lightning-moe generate CKPT --prompt "def main("           # continue a prompt (greedy; --temperature samples)
    lightning-moe test --config ... --ckpt_path CKPT           # test_loss / test_ppl on the held-out documents
    lightning-moe plan --config ... --gpu_memory 80GB          # per-rank memory before launching; --search
    lightning-moe fit --config examples/configs/hf_finetune_tiny.yaml   # fine-tune a Hugging Face model

A LightningCLI whose ``model:`` and ``data:`` are any LightningModule and LightningDataModule,
named by ``class_path`` (``model: {class_path: my_project.MyModel, init_args: {...}}``); without a
``class_path`` they are the reference :class:`~lightning_moe.lit.MoELanguageModel` and
:class:`~lightning_moe.lit.TextDataModule`, so a ``model:`` section of plain fields configures the
reference model (``data: null`` uses the LightningModule's own dataloaders). The strategy is any
``class_path`` (usually ``lightning_moe.strategies.MoEStrategy``) or the registered name ``moe``.

Before ``fit`` (or validate/test/predict) starts any process, the CLI checks the model against
the strategy's layout (:func:`~lightning_moe.parallel.layout.check.check_model_layout` on a
meta-device copy): num_experts vs EP, heads and widths vs TP, TP with a model that has no
tensor-parallel plan; and the configuration (:mod:`lightning_moe.cli_checks`): ``init_from``'s
family and ``model_overrides``' keys (before the model is built), the batch size against
``num_microbatches`` under PP, ``seq_len`` against CP and TP and ``max_seq_len``, ``val_fraction``
against the corpus' documents. A problem is reported once, by the launching process, in one
message without a traceback (exit status 2); such an error found after the launch (a
:class:`~lightning_moe.parallel.config_error.ConfigError`) is printed by rank zero only.

``--ckpt_path last`` looks in the checkpoint folder of *this* run's logger version
(``<save_dir>/<name>/version_N/checkpoints`` unless ``ModelCheckpoint(dirpath=...)`` is set), so
resume with the same ``--trainer.logger.init_args.version`` or an explicit path.

``export`` (:mod:`lightning_moe.checkpoint.export`) writes the model's global state dict
of a checkpoint of any layout, sharded or consolidated, as one ``torch.save`` file that loads with
``torch.load(weights_only=True)`` and ``load_state_dict(strict=True)``; it needs no model class.
``export --format hf`` writes the reference model of such a checkpoint as a Hugging Face directory
(``config.json`` + safetensors) that ``transformers`` loads
(:mod:`lightning_moe.checkpoint.export_hf`). ``model: {init_from: DIR}`` starts training
from a Hugging Face directory (:class:`~lightning_moe.lit.MoELanguageModel`). ``generate``
(:mod:`lightning_moe.cli_generate`) continues a prompt with such a checkpoint in one process, with
the run's tokenizer.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import lightning as L
from jsonargparse import ArgumentParser, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

import lightning_moe.strategies  # noqa: F401  (registers strategy="moe")
from lightning_moe.checkpoint.export import ExportedCheckpoint, export_checkpoint
from lightning_moe.checkpoint.export_hf import export_hf
from lightning_moe.checkpoint.integrity import CheckpointIntegrityError
from lightning_moe.checkpoint.security import UnsafeCheckpointError
from lightning_moe.cli_checks import check_config_before_launch, check_init_from_before_launch
from lightning_moe.cli_ckpt_hparams import checkpoint_hyperparameters
from lightning_moe.cli_generate import GENERATE_HELP, Generated, generate_main, generate_parser
from lightning_moe.cli_help import HelpParser
from lightning_moe.cli_plan import PLAN_HELP, plan_main, plan_parser
from lightning_moe.lora.export import export_adapter, export_merged
from lightning_moe.models.hf.families import model_families
from lightning_moe.parallel.config_error import ConfigError
from lightning_moe.parallel.layout.check import check_model_layout, meta_copy
from lightning_moe.planning import Layout, Plan
from lightning_moe.strategies import MoEStrategy

__all__ = ["DEFAULT_DATA", "DEFAULT_MODEL", "MoECLI", "check_layout_before_launch", "cli_main", "export_main", "main"]

DEFAULT_MODEL = "lightning_moe.lit.MoELanguageModel"
"""The ``model:`` class when the configuration names none."""
DEFAULT_DATA = "lightning_moe.lit.TextDataModule"
"""The ``data:`` class when the configuration names none."""
EXPORT_HELP = "Write a checkpoint's model weights (any layout) as one torch.save file or a Hugging Face directory."
_PROG = "lightning-moe"
# What a user can fix from the message alone: reported in one line, without a traceback.
_EXPORT_ERRORS = (OSError, ValueError, RuntimeError, CheckpointIntegrityError, UnsafeCheckpointError)


def export_parser() -> ArgumentParser:
    """The parser of ``lightning-moe export``."""
    parser = ArgumentParser(
        prog=f"{_PROG} export",
        description=(
            f"{EXPORT_HELP} CKPT is a checkpoint of any layout: a sharded MoEStrategy directory (any TP/EP/ETP) "
            "or a consolidated file. OUT gets the model's global state dict, keys as in model.state_dict() of the "
            "single-device LightningModule: load it with torch.load(OUT, weights_only=True) and "
            "model.load_state_dict(state, strict=True). No model class is needed; optimizer states are left out. "
            "The export reads and writes one tensor at a time: it needs memory for about twice the largest tensor, "
            "not for the model."
        ),
    )
    parser.add_argument("checkpoint", metavar="CKPT", type=str, help="The checkpoint directory or file.")
    parser.add_argument(
        "output", metavar="OUT", type=str,
        help="The file (--format torch) or directory (--format hf) to write, atomically.",
    )
    parser.add_argument(
        "--format", dest="format", choices=["torch", "hf"], default="torch",
        help="torch: one torch.save file of the global state dict; hf: a Hugging Face directory (config.json + "
        "safetensors) of a MoELanguageModel checkpoint, which transformers loads.",
    )
    parser.add_argument(
        "--family", default=None, choices=model_families(),
        help="--format hf, --merge --format hf, --adapter: the Hugging Face family (default: the init_from "
        "directory's, else inferred).",
    )
    parser.add_argument(
        "--max-shard-size", dest="max_shard_size", default="5GB",
        help="--format hf: the largest safetensors file (bytes, or e.g. 5GB, 500MB); past it the weights go into "
        "model-0000i-of-0000N.safetensors shards listed by model.safetensors.index.json, as transformers writes them.",
    )
    parser.add_argument(
        "--merge", action="store_true",
        help="A LoRA checkpoint: write the plain model with the adapters folded in (either format), its base read "
        "from the init_from directory the run recorded (or --base) and checked against the recorded fingerprint. "
        "Holds the whole model in memory.",
    )
    parser.add_argument(
        "--adapter", action="store_true",
        help="A LoRA checkpoint: write its adapters alone as a PEFT directory (adapter_config.json + "
        "adapter_model.safetensors) for the Hugging Face model the run started from; adapters PEFT cannot apply "
        "(the shared experts' and dense MLPs' in MoE families) are refused.",
    )
    parser.add_argument("--base", default=None, help="--merge: the base model's Hugging Face directory (default: the "
                        "run's init_from); --adapter: the base_model_name_or_path to record.")
    parser.add_argument("--overwrite", action="store_true", help="Replace OUT if it exists (default: refuse).")
    parser.add_argument(
        "--no-verify", dest="no_verify", action="store_true",
        help="Skip the SHA-256 check of every shard (completeness and sizes are still checked).",
    )
    return parser


def export_main(args: list[str]) -> ExportedCheckpoint:
    """``lightning-moe export ARGS``: export, print one line; a failure exits with status 1 and a
    one-line message (usage errors with 2)."""
    options = export_parser().parse_args(args)
    try:
        if options.merge and options.adapter:
            raise ValueError("--merge and --adapter exclude each other: write the merged model or the adapters alone.")
        if options.adapter:
            if options.format != "torch" or options.max_shard_size != "5GB":
                raise ValueError("--adapter writes PEFT's format (one adapter_model.safetensors); leave out --format "
                                 "and --max-shard-size.")
            summary = export_adapter(options.checkpoint, options.output, family=options.family, base=options.base,
                                     overwrite=options.overwrite, verify=not options.no_verify)
        elif options.merge:
            summary = export_merged(options.checkpoint, options.output, fmt=options.format, base=options.base,
                                    family=options.family, overwrite=options.overwrite, verify=not options.no_verify,
                                    max_shard_size=options.max_shard_size)
        elif options.base is not None:
            raise ValueError("--base goes with --merge or --adapter (it names the base model of a LoRA checkpoint).")
        elif options.format == "hf":
            summary = export_hf(options.checkpoint, options.output, family=options.family, overwrite=options.overwrite,
                                verify=not options.no_verify, max_shard_size=options.max_shard_size)
        else:
            summary = export_checkpoint(options.checkpoint, options.output, overwrite=options.overwrite,
                                        verify=not options.no_verify)
    except _EXPORT_ERRORS as err:
        text = err.strerror if isinstance(err, OSError) and err.strerror else str(err)  # no "[Errno 2]"
        message = " ".join(text.split())  # one line, whatever the error's own layout
        print(f"{_PROG} export: error: {message}", file=sys.stderr)
        raise SystemExit(1) from err
    print(summary.describe())
    return summary


def check_layout_before_launch(model: L.LightningModule | None, strategy: Any) -> None:
    """Raise :class:`~lightning_moe.parallel.layout.check.LayoutError` if ``strategy`` (a
    ``MoEStrategy``) cannot shard ``model``; no process is started and ``model`` is not changed.

    A model whose meta-device copy cannot be made (e.g. its ``configure_model`` needs the Trainer)
    is left to the same checks on every rank at setup.
    """
    if model is None or not isinstance(strategy, MoEStrategy):
        return
    dims = strategy.parallel_dims(strategy.num_nodes * strategy.num_processes)
    try:
        probe = meta_copy(model)
    except Exception as err:
        rank_zero_info(
            f"lightning-moe: the layout is checked on every rank at setup instead of now: a meta-device copy "
            f"of {type(model).__name__} could not be built ({type(err).__name__}: {err})."
        )
        return
    check_model_layout(probe, dims)


class MoECLI(LightningCLI):
    """LightningCLI for lightning_moe (``lightning-moe``): any model and data by ``class_path``,
    the reference ones by default; layout errors before any process starts; an ``export`` command.

    Use :func:`cli_main` (it dispatches ``export``, which this class does not run itself).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("parser_class", HelpParser)  # --help without the docstrings' Sphinx markup
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Default ``model:``/``data:`` classes, so sections without ``class_path`` configure the reference ones."""
        parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}, "data": {"class_path": DEFAULT_DATA}})

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        super()._add_subcommands(parser, **kwargs)
        # Listed in `lightning-moe --help`; run by cli_main before LightningCLI parses anything.
        subcommands = getattr(parser, "_subcommands_action", None)
        if subcommands is not None:
            subcommands.add_subcommand("export", export_parser(), help=EXPORT_HELP)
            subcommands.add_subcommand("generate", generate_parser(), help=GENERATE_HELP)
            subcommands.add_subcommand("plan", plan_parser(), help=PLAN_HELP)

    def _parse_ckpt_path(self) -> None:
        """Merge a ``--ckpt_path`` file's hyperparameters into the reference model's configuration,
        as plain values only (:func:`~lightning_moe.cli_ckpt_hparams.checkpoint_hyperparameters`).

        LightningCLI's own merge lets a file from someone else name classes to build. Here nothing a
        checkpoint holds is built: a ``class_path`` anywhere in it is refused, and the hyperparameters
        reach only the reference model, whose parameters are all plain-typed; another model class
        takes its configuration from ``--config``/``--model.*`` alone.
        """
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path or not Path(ckpt_path).is_file():
            return  # a sharded checkpoint folder or "last": Lightning merges nothing either
        model = self.config[subcommand].get("model")
        class_path = model.get("class_path") if model is not None and hasattr(model, "get") else None
        names = {str(class_path), DEFAULT_MODEL} if _is_reference_model(class_path) else {str(class_path)}
        hparams = checkpoint_hyperparameters(ckpt_path, names)
        if not hparams:
            return
        if not _is_reference_model(class_path):
            rank_zero_info(
                f"lightning-moe: the hyperparameters of {ckpt_path} are not merged into {class_path}'s "
                "configuration (only the reference model's are); give them with --config or --model.*."
            )
            return
        self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)

    def before_instantiate_classes(self) -> None:
        """Check ``init_from`` and ``model_overrides`` of the reference model before it is built."""
        config = self.config.get(self.subcommand) if self.subcommand is not None else self.config
        model = config.get("model") if config is not None else None
        init_args = model.get("init_args") if model is not None and hasattr(model, "get") else None
        init_from = init_args.get("init_from") if init_args is not None else None
        if init_from is not None and _is_reference_model(model.get("class_path")):
            overrides = init_args.get("model_overrides")
            check_init_from_before_launch(str(init_from), _plain(overrides))

    def after_instantiate_classes(self) -> None:
        """Check the model against the layout, and the data against both, before the subcommand
        launches any process (:mod:`lightning_moe.cli_checks`)."""
        if self.subcommand is not None:
            check_layout_before_launch(self.model, self.trainer.strategy)
            check_config_before_launch(self.model, self.datamodule, self.trainer.strategy, self.subcommand)


def _is_reference_model(class_path: Any) -> bool:
    from lightning_moe.lit import MoELanguageModel

    if not isinstance(class_path, str):
        return False
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return False  # jsonargparse reports it
    return isinstance(cls, type) and issubclass(cls, MoELanguageModel)


def _plain(value: Any) -> Any:
    """A jsonargparse Namespace (and its nesting) as plain dicts."""
    if hasattr(value, "as_dict"):
        return value.as_dict()
    return value


def cli_main(
    args: list[str] | None = None,
) -> MoECLI | ExportedCheckpoint | Generated | Plan | list[tuple[Layout, Plan]]:
    """Run the CLI on ``args`` (default: the command line) and return it (for tests and notebooks);
    ``export ...`` returns what :func:`export_main` exported, ``generate ...`` what
    :func:`~lightning_moe.cli_generate.generate_main` generated, ``plan ...`` the
    :class:`~lightning_moe.planning.Plan` (or ``--search``'s ranked layouts)."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    if argv[:1] == ["generate"]:
        return generate_main(argv[1:])
    if argv[:1] == ["plan"]:
        return plan_main(argv[1:])
    # Field docstrings of the config dataclasses become --help text.
    # A class_path under an Any-typed field stays a mapping (the default of jsonargparse 5): a
    # configuration or a checkpoint's hyperparameters never name objects to build there.
    set_parsing_settings(docstring_parse_attribute_docstrings=True, instantiate_subclass_spec_in_any=False)
    return MoECLI(
        L.LightningModule,
        L.LightningDataModule,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def main() -> None:
    """Entry point of the ``lightning-moe`` console script.

    A :class:`~lightning_moe.parallel.config_error.ConfigError` (layout errors included) is a
    configuration mistake, the same on every rank: it is printed once, by rank zero, without a
    traceback (the launching process, before any rank starts, for the CLI's own checks), and every
    rank exits with status 2.
    """
    try:
        cli_main()
    except ConfigError as err:  # the message says what to change
        if rank_zero_only.rank == 0:
            print(f"{_PROG}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from err


if __name__ == "__main__":
    main()
