"""The installed ``lightning-moe`` console script, for tests that run it as a user would."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest


def console_script() -> str:
    """Path of the ``lightning-moe`` script next to this Python (skips the test if it is not installed)."""
    script = shutil.which("lightning-moe", path=str(Path(sys.executable).parent)) or shutil.which("lightning-moe")
    if script is None:
        pytest.skip("the lightning-moe console script is not installed (pip install -e .)")
    return script
