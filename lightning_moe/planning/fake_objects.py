"""``broadcast_object_list`` between the ranks one process plays in turn on the fake backend."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["AwaitsObject", "FakeObjects"]


class AwaitsObject(Exception):
    """A fake rank needs an object another rank computes (a pipeline stage's boundary shapes) that no
    rank planned so far has sent: plan the sending rank first (`FakeObjects`), then this one again.
    ``key``: the broadcast's key in `FakeObjects.sent`."""

    def __init__(self, message: str, key: tuple[str, int] | None = None) -> None:
        super().__init__(message)
        self.key = key


class FakeObjects:
    """``broadcast_object_list`` across the ranks one process plays in turn on the fake backend.

    A fake broadcast sends nothing. Here the source rank's objects are kept, keyed by the call's
    site and its count there (every rank runs the same code, so the n-th broadcast at a site is the
    same broadcast on all), and a receiving rank gets them from the store: what the source would
    have sent. A receiver whose objects the store does not hold yet keeps its own when it has them
    all (computed alike on every rank: seeds), else asks ``fetch``, which may wait for a rank planned
    at the same time to send it (``publish``), and else raises `AwaitsObject`: the planner then
    plans the other ranks first and this one again.
    """

    def __init__(self, publish: Callable[[tuple[str, int], list], None] | None = None,
                 fetch: Callable[[tuple[str, int]], list | None] | None = None) -> None:
        self.sent: dict[tuple[str, int], list] = {}
        self._calls: dict[str, int] = {}
        self.publish = publish
        """Called with each object this rank sends, as it sends it (ranks planned at the same time)."""
        self.fetch = fetch
        """Asked for an object the store lacks: waits for it and returns it, or None (then
        `AwaitsObject` is raised)."""

    def new_rank(self) -> None:
        """Count the calls of a new rank from zero."""
        self._calls = {}

    def broadcast_object_list(self, objects: list, src: int | None = None, group=None, device=None,
                              group_src: int | None = None) -> None:
        """``torch.distributed.broadcast_object_list`` between fake ranks (class docstring)."""
        caller = sys._getframe(1)
        site = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        index = self._calls.get(site, 0)
        self._calls[site] = index + 1
        if group_src is not None:
            src = dist.get_global_rank(group, group_src)
        key = (site, index)
        if src == dist.get_rank():
            self.sent[key] = copy.deepcopy(objects)
            if self.publish is not None:
                self.publish(key, self.sent[key])
            return
        if key not in self.sent and any(o is None for o in objects) and self.fetch is not None:
            fetched = self.fetch(key)
            if fetched is not None:
                self.sent[key] = fetched
        if key in self.sent:
            objects[:] = copy.deepcopy(self.sent[key])
        elif any(o is None for o in objects):
            raise AwaitsObject(f"broadcast at {site} (call {index}) from rank {src}", key)
