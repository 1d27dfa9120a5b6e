"""Joining the default process group (:func:`connect`), and a cluster environment for processes
whose ``torch.distributed`` default group already exists.

Test harnesses, notebooks driving their own ranks and custom launchers may initialise the
default process group before building the Trainer. Lightning must then neither launch processes
nor read ranks from environment variables: the group is the source of truth.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment

from lightning_moe.compat import init_dist_connection, set_default_group_timeout

__all__ = ["ExistingProcessGroupEnvironment", "connect"]


def connect(environment: ClusterEnvironment, backend: str, device: torch.device,
            startup_timeout: timedelta | None, timeout: timedelta | None) -> None:
    """Initialise the default process group unless it exists.

    The rendezvous waits up to ``startup_timeout`` for every rank (each still importing or loading
    at its own pace); the group's collectives then time out after ``timeout``.
    """
    if dist.is_initialized():
        return
    kwargs = {"timeout": startup_timeout} if device.type == "cpu" else {"timeout": startup_timeout, "device_id": device}
    init_dist_connection(environment, backend, **kwargs)
    if timeout is not None:
        set_default_group_timeout(timeout)


class ExistingProcessGroupEnvironment(ClusterEnvironment):
    """Ranks and world size taken from the initialised default process group."""

    def __init__(self, processes_per_node: int | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ExistingProcessGroupEnvironment needs torch.distributed to be initialised first.")
        self._per_node = processes_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        self._per_node_given = processes_per_node is not None or "LOCAL_WORLD_SIZE" in os.environ

    def use_processes_per_node(self, processes_per_node: int) -> None:
        """The Trainer's ``devices``: the processes per node, unless given at construction or by
        ``LOCAL_WORLD_SIZE`` (a group made before the Trainer knows no node size: each node's ranks
        would otherwise be taken for one node's, and a rank past the first node has no device)."""
        if processes_per_node and not self._per_node_given:
            self._per_node = processes_per_node

    @property
    def creates_processes_externally(self) -> bool:
        """The processes exist already: Lightning launches nothing."""
        return True

    @property
    def main_address(self) -> str:
        """Unused: the group is connected already."""
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        """Unused: the group is connected already."""
        return int(os.environ.get("MASTER_PORT", 0))

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """The Trainer's ``devices * num_nodes`` must be the size of the existing group."""
        world = dist.get_world_size()
        if num_devices * num_nodes != world:
            raise ValueError(
                f"torch.distributed is already initialised with {world} processes, but the Trainer was "
                f"given devices={num_devices} x num_nodes={num_nodes} = {num_devices * num_nodes}. "
                f"Set devices={world // max(num_nodes, 1)} (and num_nodes) to match the process group."
            )

    @staticmethod
    def detect() -> bool:
        """True when a default process group exists."""
        return dist.is_available() and dist.is_initialized()

    def world_size(self) -> int:
        """Size of the default process group."""
        return dist.get_world_size()

    def set_world_size(self, size: int) -> None:
        """Ignored: the default process group fixes the world size."""

    def global_rank(self) -> int:
        """This process's rank in the default process group."""
        return dist.get_rank()

    def set_global_rank(self, rank: int) -> None:
        """Ignored: the default process group fixes the rank."""

    def local_rank(self) -> int:
        """``LOCAL_RANK`` if set, else the rank within its node."""
        return int(os.environ.get("LOCAL_RANK", dist.get_rank() % self._per_node))

    def node_rank(self) -> int:
        """The node of this process, from the processes per node."""
        return dist.get_rank() // self._per_node
