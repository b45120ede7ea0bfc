"""When the device-plugin front end asks, while it holds allocations, which
pods still hold their devices (the kubelet's PodResources API).

An allocation ends when PodResources no longer lists a pod holding its
devices (`AllocationBook.release_unheld`). So while allocations are held the
front end asks regularly: first once the oldest is past its release grace
(a pod just admitted may not be listed yet), then every `interval` after the
last ask or answer, whichever came later, so that an API that does not
answer is asked again at the same pace. The kubelet's sync asks on its own
schedule (`sync`), and a refused split or a kubelet's start asks at once;
the shell asks on every `RefreshAllocations`, spacing asks that come
together.
"""

from __future__ import annotations

from .allocations import AllocationBook
from .effects import RefreshAllocations

__all__ = ["HELD_POLL", "HeldPolls"]

HELD_POLL = RefreshAllocations("allocations are held: which pods still hold their devices")


class HeldPolls:
    """The regular asks while `book` holds allocations."""

    def __init__(self, book: AllocationBook, interval: float) -> None:
        if interval <= 0:
            raise ValueError(f"the PodResources interval must be positive, not {interval}")
        self._book = book
        self.interval = interval
        self._last = float("-inf")  # the last ask or answer

    def answered(self, now: float) -> None:
        self._last = max(self._last, now)

    def next_at(self) -> float | None:
        """When to ask next; None while nothing is held."""
        if not len(self._book):
            return None
        release = self._book.next_release_check()
        due = self._last + self.interval
        return max(release, due) if release is not None else due

    def due(self, now: float) -> list[RefreshAllocations]:
        at = self.next_at()
        if at is None or now < at:
            return []
        self._last = now
        return [HELD_POLL]
