"""The runtime's background tasks: started, kept, and cancelled together.

Some of them dp cannot work without (the timer loop, the file watch, the
slice publisher): each is spawned with a name as `essential`, and runs until
dp stops. Should one end before that, whatever the reason, it is logged as
`essential-task-ended` with why, `ended` keeps it, and the liveness probe
fails on it: a restart is the only cure for a loop that is gone. Those tasks
meet outages (an API server away, a kubelet restarting) by retrying inside,
so an outage never ends one and never fails liveness.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["Tasks"]

_log = logging.getLogger("dp.runtime")
_T = TypeVar("_T")


class Tasks:
    """Tasks on the running loop; one that fails is logged, not lost."""

    def __init__(self, stopping: Callable[[], bool] = lambda: False) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()  # a loop keeps weak references
        self._essential: dict[asyncio.Task[Any], str] = {}
        self._stopping = stopping  # an essential task may end once dp is stopping
        self._cancelling = False
        # Every essential task spawned, by name -> why it ended ("" while it runs).
        self.essential: dict[str, str] = {}

    def spawn(
        self, coroutine: Coroutine[Any, Any, _T], *, essential: str | None = None
    ) -> asyncio.Task[_T]:
        task = asyncio.get_running_loop().create_task(coroutine, name=essential)
        self._tasks.add(task)
        if essential is not None:
            self._essential[task] = essential
            self.essential[essential] = ""
        task.add_done_callback(self._done)
        return task

    @property
    def ended(self) -> dict[str, str]:
        """The essential tasks that ended while dp ran, and why."""
        return {name: why for name, why in self.essential.items() if why}

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        name = self._essential.pop(task, None)
        error = None if task.cancelled() else task.exception()
        if name is not None and not (self._cancelling or self._stopping()):
            if task.cancelled():
                why = "cancelled"
            elif error is not None:
                why = f"{type(error).__name__}: {error}"
            else:
                why = "returned"
            self.essential[name] = why
            _log.error(
                "essential-task-ended",
                extra={"dp_fields": {"task": name, "reason": why}},
                exc_info=error,
            )
        elif error is not None:
            _log.error("task-failed", exc_info=error)

    async def cancel_all(self) -> None:
        self._cancelling = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
