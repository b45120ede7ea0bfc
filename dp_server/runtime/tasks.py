"""The runtime's background tasks: started, kept, and cancelled together."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["Tasks"]

_log = logging.getLogger("dp.runtime")
_T = TypeVar("_T")


class Tasks:
    """Tasks on the running loop; one that fails is logged, not lost."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()  # a loop keeps weak references

    def spawn(self, coroutine: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            _log.error("task-failed", exc_info=task.exception())

    async def cancel_all(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
