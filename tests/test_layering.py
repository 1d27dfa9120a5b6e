"""Enforce the package layering of docs/architecture.md §1 by reading the source, not by convention.

The core subpackages must work without Lightning (plain torchrun scripts use them), and
``layers/`` holds single-device code only: collectives belong in ``parallel/``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = REPO_ROOT / "lightning_moe"
CORE_SUBPACKAGES = (
    "layers", "parallel", "checkpoint", "memory", "graphs", "precision", "metrics", "models", "data"
)
LIGHTNING_MODULES = ("lightning", "pytorch_lightning")


def _existing_core_dirs() -> list[Path]:
    return [PACKAGE_DIR / name for name in CORE_SUBPACKAGES if (PACKAGE_DIR / name).is_dir()]


def _python_files(directories: list[Path]) -> list[Path]:
    return sorted(path for directory in directories for path in directory.rglob("*.py"))


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(REPO_ROOT)}:{node.lineno}"


def _imported_modules(node: ast.AST) -> list[str]:
    """Absolute module names an import statement brings in (relative imports stay in the package)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        # `from torch import distributed` imports torch.distributed, so list the submodule form too.
        return [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return []


def _is_within(module: str, package: str) -> bool:
    # Compare whole dotted components: `lightning_moe` is not inside `lightning`.
    return module == package or module.startswith(package + ".")


def test_core_subpackages_exist():
    # Guard against the scans below passing vacuously because the package moved.
    assert _python_files([PACKAGE_DIR / "layers"]), f"no Python files under {PACKAGE_DIR / 'layers'}"


def _first_import_within(node: ast.AST, packages: tuple[str, ...]) -> str | None:
    """The first module ``node`` imports from any of ``packages``, or None (one report per statement)."""
    return next(
        (module for module in _imported_modules(node) if any(_is_within(module, p) for p in packages)), None
    )


def test_core_subpackages_do_not_import_lightning():
    offenders = [
        f"{_where(path, node)}: imports {module}"
        for path in _python_files(_existing_core_dirs())
        for node in ast.walk(_parse(path))
        if (module := _first_import_within(node, LIGHTNING_MODULES)) is not None
    ]
    allowed = "strategies/, callbacks/, plugins/, lit/ and cli.py"
    assert not offenders, f"Lightning may only be imported by {allowed}:\n" + "\n".join(offenders)


def _distributed_uses(tree: ast.Module) -> list[tuple[ast.AST, str]]:
    uses = []
    for node in ast.walk(tree):
        if (module := _first_import_within(node, ("torch.distributed",))) is not None:
            uses.append((node, f"imports {module}"))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "torch" and node.attr == "distributed":
                uses.append((node, "uses torch.distributed"))
            elif node.value.id == "dist":
                uses.append((node, f"uses dist.{node.attr}"))
    return uses


def test_layers_do_not_use_torch_distributed():
    offenders = [
        f"{_where(path, node)}: {what}"
        for path in _python_files([PACKAGE_DIR / "layers"])
        for node, what in _distributed_uses(_parse(path))
    ]
    assert not offenders, "layers/ is single-device code; move collectives to parallel/:\n" + "\n".join(
        offenders
    )


def test_importing_the_core_does_not_import_lightning():
    modules = ["lightning_moe"] + [f"lightning_moe.{path.name}" for path in _existing_core_dirs()]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {LIGHTNING_MODULES!r}))\n"
    )
    # A fresh interpreter, because this test process may already have imported Lightning; the
    # checkout under test goes first on the path.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    if result.returncode != 0:
        pytest.fail(f"importing {modules} failed:\n{result.stderr}")
    assert result.stdout.strip() == "[]", (
        f"importing {modules} loaded Lightning modules: {result.stdout.strip()}"
    )


# The core packages that every model shares never import a particular model: what they need of one
# is declared by the model (lightning_moe.parallel.model_plan). Persistence (lightning_moe.checkpoint)
# may import models, for the Hugging Face formats, so it sits above them and parallel/ never imports it.
MODEL_FREE_SUBPACKAGES = ("parallel", "graphs", "memory", "layers")
MODEL_PACKAGES = ("lightning_moe.models", "lightning_moe.lit")


def _top_level_origin(node: ast.AST) -> list[str]:
    """For ``from lightning_moe import X``: the module each ``X`` is defined in (a re-exported model class)."""
    if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "lightning_moe"):
        return []
    import lightning_moe

    origins = []
    for alias in node.names:
        value = getattr(lightning_moe, alias.name, None)
        origin = getattr(value, "__module__", None) or getattr(value, "__name__", None)
        if isinstance(origin, str):
            origins.append(origin)
    return origins


def _model_imports(tree: ast.Module) -> list[tuple[ast.AST, str]]:
    """``(statement, model module)`` of every import in ``tree`` that reaches ``models/`` or ``lit/``."""
    found = []
    for node in ast.walk(tree):
        module = _first_import_within(node, MODEL_PACKAGES)
        if module is None:
            module = next((m for m in _top_level_origin(node) if any(_is_within(m, p) for p in MODEL_PACKAGES)), None)
        if module is not None:
            found.append((node, module))
    return found


def test_core_packages_import_no_model():
    directories = [PACKAGE_DIR / name for name in MODEL_FREE_SUBPACKAGES]
    assert all(d.is_dir() for d in directories), directories
    offenders = [
        f"{_where(path, node)}: imports {module}"
        for path in _python_files(directories)
        for node, module in _model_imports(_parse(path))
    ]
    assert not offenders, (
        f"{', '.join(MODEL_FREE_SUBPACKAGES)} must not import {' or '.join(MODEL_PACKAGES)}; a model hands what "
        "they need over through parallel_plan() (lightning_moe.parallel.model_plan):\n" + "\n".join(offenders)
    )


def test_the_model_import_rule_sees_every_import_form():
    """The scan catches plain, from-, submodule, function-level and re-exported imports of a model."""
    tree = ast.parse(
        "import lightning_moe.models\n"
        "from lightning_moe.models.transformer import TransformerBlock\n"
        "from lightning_moe import lit\n"
        "from lightning_moe import swap_moe_blocks\n"
        "def f():\n"
        "    from lightning_moe.lit.module import MoELanguageModel\n"
        "from lightning_moe.layers.moe import MoELayer\n"
        "from lightning_moe import MoELayer as Layer\n"
    )
    assert sorted(node.lineno for node, _ in _model_imports(tree)) == [1, 2, 3, 4, 6]


def test_parallel_does_not_import_persistence():
    """``parallel/`` lays out and runs a model; saving and loading sit above it in ``checkpoint/``."""
    assert _python_files([PACKAGE_DIR / "checkpoint"]), f"no Python files under {PACKAGE_DIR / 'checkpoint'}"
    offenders = [
        f"{_where(path, node)}: imports {module}"
        for path in _python_files([PACKAGE_DIR / "parallel"])
        for node in ast.walk(_parse(path))
        if (module := _first_import_within(node, ("lightning_moe.checkpoint",))) is not None
    ]
    assert not offenders, (
        "parallel/ must not import lightning_moe.checkpoint (persistence imports parallel/ and models/); "
        "move the shared piece into parallel/ or pass it in:\n" + "\n".join(offenders)
    )


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """Nodes under ``if TYPE_CHECKING:``: annotations only, never run, so no import arrow."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(sub) for statement in node.body for sub in ast.walk(statement))
    return inside


def _package_imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``tree`` imports anywhere (module level or inside functions)."""
    skipped = _type_checking_nodes(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif node.level == 0 and node.module in modules:
            # `from package import submodule` imports the submodule; `from module import name` the module.
            for alias in node.names:
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module)
    return found


def _two_module_cycles(imports: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} <-> {b}" for a, targets in imports.items() for b in targets if a < b and a in imports.get(b, ())
    )


def test_no_two_modules_import_each_other():
    paths = _python_files([PACKAGE_DIR])
    modules = {_module_name(path) for path in paths}
    assert "lightning_moe.parallel.parallelize" in modules, sorted(modules)[:5]
    imports = {_module_name(path): _package_imports(_parse(path), modules) - {_module_name(path)} for path in paths}
    cycles = _two_module_cycles(imports)
    assert not cycles, (
        "two modules import each other (a function-level import counts); move what both need into the "
        "lower one or a new module below both, or take it as an argument:\n" + "\n".join(cycles)
    )


def test_the_cycle_rule_sees_function_level_imports_and_ignores_type_checking():
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    a = ast.parse("from pkg.b import f\n")
    b = ast.parse("def g():\n    from pkg import a\n")
    c = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import X\n")
    imports = {"pkg.a": _package_imports(a, modules) | {"pkg.c"}, "pkg.b": _package_imports(b, modules),
               "pkg.c": _package_imports(c, modules)}
    assert imports["pkg.c"] == set()
    assert _two_module_cycles(imports) == ["pkg.a <-> pkg.b"]
