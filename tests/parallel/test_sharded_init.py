"""Importing lightning_moe installs nothing: DTensor weights get their initial values only after
``enable_sharded_init`` (which every sharding function of ``lightning_moe.parallel`` calls)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

# A fresh interpreter, so nothing that an earlier test in this process sharded has installed the writer.
_SCRIPT = """
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import lightning_moe, lightning_moe.parallel, lightning_moe.checkpoint  # noqa: F401 (importing must install nothing)
from lightning_moe.layers.weight_init import write_full
from lightning_moe.parallel.sharded_init import enable_sharded_init

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
weight = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])
values = torch.arange(12.0).view(4, 3)
try:
    write_full(weight, values)
    print("written without a writer")
except RuntimeError as error:
    print("refused, naming the fix:", "enable_sharded_init()" in str(error))
enable_sharded_init()
write_full(weight, values)
print("equal after enable:", torch.equal(weight.full_tensor(), values))
dist.destroy_process_group()
"""


def test_importing_installs_no_writer_and_enable_installs_it():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    if result.returncode != 0:
        pytest.fail(f"the script failed:\n{result.stderr}")
    assert result.stdout.splitlines() == ["refused, naming the fix: True", "equal after enable: True"], result.stdout
