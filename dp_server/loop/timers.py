"""The one loop that wakes the server at its deadlines.

Each `Timer` says when it is next due and what to do then: the node's own
deadlines (backoffs, dial waits, release grace), rescans, PodResources polls,
and a changed config file that has settled. The loop sleeps until the
earliest, and is woken early only when an input moved a deadline earlier.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Protocol

__all__ = ["CallbackTimer", "Timer", "TimerLoop"]


class Timer(Protocol):
    def due_at(self, now: float) -> float | None:
        """When this is next due; None: not at all until something changes."""

    def fire(self, now: float) -> None:
        """It is due: do what it is for."""


class CallbackTimer:
    """A `Timer` made of two callables."""

    def __init__(
        self, due_at: Callable[[float], float | None], fire: Callable[[float], None]
    ) -> None:
        self.due_at = due_at
        self.fire = fire


class TimerLoop:
    def __init__(self, timers: Sequence[Timer], now: Callable[[], float]) -> None:
        self._timers = timers
        self._now = now
        self._wake = asyncio.Event()
        self._sleeping_until: float | None = None  # None: awake, or not started
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    def deadline(self) -> float | None:
        now = self._now()
        due = [at for timer in self._timers if (at := timer.due_at(now)) is not None]
        return min(due) if due else None

    def poke(self) -> None:
        """Something changed: wake the loop if that moved the earliest deadline earlier.

        Waking costs a task switch; most inputs (every Allocate) leave the
        deadlines alone, and a deadline moved later only makes a wake-up early.
        """
        if self._sleeping_until is None:
            self._wake.set()
            return
        deadline = self.deadline()
        if deadline is not None and deadline < self._sleeping_until:
            self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    @property
    def stopped(self) -> bool:
        """Whether the loop has ended (it runs until `stop()`; a crash ends it too)."""
        return self._task is not None and self._task.done()

    async def run(self) -> None:
        self._task = asyncio.current_task()
        while not self._stopping:
            deadline = self.deadline()
            self._sleeping_until = float("inf") if deadline is None else deadline
            timeout = None if deadline is None else max(0.0, deadline - self._now())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            self._sleeping_until = None
            if self._stopping:
                return
            now = self._now()
            for timer in self._timers:
                at = timer.due_at(now)
                if at is not None and at <= now:
                    timer.fire(now)
