"""How fast the slice publisher may try again: after a failure, and when it repairs.

dp's one `Backoff` (the core's) spaces the retries of a session that failed,
scaled by a random 0.5-1 (`jitter`) so that many nodes do not retry in step.
`RepairPacer` bounds
the writes that outside changes cause: a pass that writes although the
wanted content did not change since the server last held it is a repair
(someone deleted or changed a slice, the Node's garbage collector took the
pool, the Node came back with a new UID). The first repair after a quiet
spell goes at once, so a kubelet that wipes its node's slices at start gets
them back within a round trip; each further one waits longer, from its
predecessor: `Backoff.delay(n)` for the n-th in a row, jittered: 0.5 to 1 s, 1 to 2 s,
and so on up to `cap`. However the outside keeps undoing the pool, dp writes
at most one pass of the pool per `cap / 2` seconds once the fight is long.
"""

from __future__ import annotations

import random

from dp_core import Backoff

__all__ = ["RepairPacer", "jitter"]


def jitter(rng: random.Random) -> float:
    """A random factor of 0.5-1 for a delay."""
    return rng.uniform(0.5, 1.0)


class RepairPacer:
    """When the next repair may be written, given the ones before it.

    A repair more than `quiet` seconds after the previous one starts the
    count again (and goes at once).
    """

    def __init__(
        self, backoff: Backoff | None = None, quiet: float = 60.0, rng: random.Random | None = None
    ) -> None:
        self.backoff = backoff or Backoff(first=1.0, cap=16.0)
        self.quiet = quiet
        self._rng = rng or random.Random()
        self._in_a_row = 0
        self._last: float | None = None
        self._gap = 0.0  # the wait the next repair owes its predecessor
        self.repairs = 0

    def not_before(self, now: float) -> float:
        """The earliest time the repair wanted at `now` may be written."""
        if self._last is None or now - self._last > self.quiet:
            return now
        return self._last + self._gap

    def wrote(self, now: float) -> None:
        """A repair was written at `now`."""
        if self._last is None or now - self._last > self.quiet:
            self._in_a_row = 0
        self._in_a_row += 1
        self._last = now
        self._gap = self.backoff.delay(self._in_a_row, jitter(self._rng))
        self.repairs += 1
