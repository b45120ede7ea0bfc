"""The node's own counters: what it did itself, whichever front end asked.

Each front end counts what concerns it, where it decides it; the node
counts host scans and moves to vfio-pci. Numbers only; the names operators
see are `metrics.collect`'s business.
"""

from __future__ import annotations

from collections import Counter

from .binding.events import BindingFinished
from .inputs import HostObserved, Input

__all__ = ["Tally"]


class Tally:
    """Monotonic counters, keyed by the labels they are reported with."""

    def __init__(self) -> None:
        self.bindings: Counter[bool] = Counter()  # succeeded -> binds carried out
        self.host_scans = 0

    def observe(self, event: Input) -> None:
        if isinstance(event, BindingFinished) and not event.withdrawn:
            self.bindings[event.error is None] += 1
        elif isinstance(event, HostObserved):
            self.host_scans += 1
