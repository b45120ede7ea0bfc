"""Binding in the running server: the core's moves carried out one at a time
(`BindQueue`), and what dp moved kept across restarts (`MovesStore`)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from dp_core import BindDevice, MovesChanged, MovesRecalled, UnbindDevice, WriteDecided
from dp_server.binding.binder import Binder
from dp_server.binding.moves_file import MovesStore
from dp_server.binding.queue import BindQueue
from dp_server.loop import Loop

__all__ = ["BindingRuntime"]


class BindingRuntime:
    """Binding wired onto `loop`: `rescan` is asked for after each batch of moves."""

    def __init__(
        self,
        loop: Loop,
        binder: Binder,
        state_dir: str | None,
        *,
        spawn: Callable[[Coroutine[Any, Any, None]], Any],
        stopping: Callable[[], bool],
        rescan: Callable[[], object],
    ) -> None:
        self._loop = loop
        self._spawn = spawn
        self._stopping = stopping
        self.moves = MovesStore(state_dir)
        self.queue = BindQueue(binder, loop.call, loop.feed, loop.now, stopping, rescan)
        loop.on(BindDevice, self._move)
        loop.on(UnbindDevice, self._move)
        loop.on(MovesChanged, self._keep_moves)
        loop.answers(WriteDecided)

    def recall(self) -> None:
        """Hand the core what an earlier run moved; before the first scan."""
        recalled = self.moves.recall()
        if recalled:
            self._loop.feed(MovesRecalled(recalled))

    def _move(self, effect: BindDevice | UnbindDevice) -> None:
        if not self._stopping():
            self._spawn(self.queue.submit(effect))

    def _keep_moves(self, effect: MovesChanged) -> None:
        self.moves.keep(effect.moves)
