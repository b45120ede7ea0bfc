"""The node's own counters: what it did itself, whichever front end asked.

Each front end counts what concerns it, where it decides it; the node
counts host scans and moves to vfio-pci. Numbers only; the names operators
see are `metrics.collect`'s business.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["Tally"]


class Tally:
    """Monotonic counters, keyed by the labels they are reported with; the
    node counts each where it handles it."""

    def __init__(self) -> None:
        self.bindings: Counter[bool] = Counter()  # succeeded -> binds carried out
        self.host_scans = 0
