"""Every install hint names a command that works from a clone, and the README's main job installs
what the README promises.

The package is not published on a package index, so ``pip install "lightning-moe[extra]"`` fails
for a newcomer; hints say ``pip install -e ".[extra]"`` (see ``lightning_moe/install_hints.py``).
The oracle is the repository itself: its ``pyproject.toml`` extras and its README's command.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_moe.install_hints import EXTRAS, install_hint

tomllib = pytest.importorskip("tomllib", reason="tomllib (reading pyproject.toml) is in Python 3.11+")

REPO = Path(__file__).resolve().parents[1]
# Files a user reads or sees messages from; the changelog records history and is left out.
SCANNED = ("lightning_moe", "benchmarks", "examples", "docs", "tests", "README.md")
PUBLISHED_NAME_EXTRA = re.compile(r"lightning-moe\\?\[")


def _extras() -> dict[str, list[str]]:
    with (REPO / "pyproject.toml").open("rb") as handle:
        return tomllib.load(handle)["project"]["optional-dependencies"]


def _scanned_files():
    for name in SCANNED:
        path = REPO / name
        if path.is_file():
            yield path
            continue
        for file in path.rglob("*"):
            if file.suffix in {".py", ".md", ".yaml", ".sh"} and file != Path(__file__):
                yield file


def test_no_hint_names_the_unpublished_package():
    found = [
        f"{file.relative_to(REPO)}:{number}"
        for file in _scanned_files()
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1)
        if PUBLISHED_NAME_EXTRA.search(line)
    ]
    assert not found, f"install hints that fail from a clone (use install_hint / pip install -e \".[x]\"): {found}"


def test_every_hinted_extra_exists_in_pyproject():
    extras = _extras()
    assert set(EXTRAS) <= set(extras), f"hints name extras pyproject.toml lacks: {set(EXTRAS) - set(extras)}"
    for extra in EXTRAS:
        assert f'pip install -e ".[{extra}]"' in install_hint(extra)


def test_unknown_extra_is_refused():
    with pytest.raises(ValueError, match="Unknown extra 'gpu'"):
        install_hint("gpu")


def test_readme_main_job_installs_the_heatmap_it_promises():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Train the reference model", 1)[1].split("\n## ", 1)[0]
    assert "heatmap" in section  # what the README promises ...
    command = next(line for line in section.splitlines() if line.startswith("python -m pip install"))
    installed = re.search(r'-e "\.\[([a-z,]+)\]"', command)
    assert installed, f"the main job's install installs no extra: {command}"
    packages = " ".join(dep for extra in installed.group(1).split(",") for dep in _extras()[extra])
    assert "matplotlib" in packages, f"the main job's install ({command}) brings no matplotlib for its heatmap"
