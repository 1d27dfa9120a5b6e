"""``lightning-moe``: train the reference MoE language model from a YAML file.

    lightning-moe fit --config examples/configs/tiny_cpu.yaml
    lightning-moe fit --config examples/configs/tiny_cpu.yaml --ckpt_path last   # resume
    lightning-moe fit --help                                                      # every option

A LightningCLI over :class:`~lightning_moe.lit.MoELanguageModel` and
:class:`~lightning_moe.lit.TextDataModule`; the strategy is any ``class_path`` (usually
``lightning_moe.strategies.MoEStrategy``) or the registered name ``moe``. Field docstrings of the
model and MoE configurations appear in ``--help``.
"""

from __future__ import annotations

from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import LightningCLI

import lightning_moe.strategies  # noqa: F401  (registers strategy="moe")
from lightning_moe.lit import MoELanguageModel, TextDataModule

__all__ = ["MoECLI", "cli_main", "main"]


class MoECLI(LightningCLI):
    """LightningCLI for the reference model (``lightning-moe``)."""


def cli_main(args: list[str] | None = None) -> MoECLI:
    """Run the CLI on ``args`` (default: the command line) and return it (for tests and notebooks)."""
    # Field docstrings of the config dataclasses become --help text.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    return MoECLI(
        MoELanguageModel,
        TextDataModule,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def main() -> None:
    """Entry point of the ``lightning-moe`` console script."""
    cli_main()


if __name__ == "__main__":
    main()
