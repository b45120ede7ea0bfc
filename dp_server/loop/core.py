"""The server's one way into the core: inputs fed one at a time, effects
carried out by the sub-system that registered for them, answers handed to
the caller that waits for them.

`feed` is not re-entrant. An input that arises while the effects of another
are carried out (a CDI spec directory reporting what it wrote, a claim's
files written) is queued and fed after the current input's effects, in
order, before control returns to the event loop: whatever reads the core
next (an Allocate) sees the outcome. An effect that answers a call carries
the call's number, and `call` finds its answer by it, not by scanning the
effects. A call the core continues later (a Prepare whose claim must be
read first) is answered by one of its effects too, and `resume` feeds the
input that continues it under the same number. Every kind of effect has
exactly one handler, registered by the
sub-system that owns it (`on`); nothing here decides anything.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from dp_core import Node

__all__ = ["CallAnswer", "Loop"]


class CallAnswer(Protocol):
    """An effect that answers call `call` (`Reply`, `Reject`, `ClaimAnswered`, ...)."""

    @property
    def call(self) -> int: ...


class Loop:
    """Feeds one `Node` and carries out its effects through registered handlers."""

    def __init__(self, node: Node[Any], clock: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        self._clock = clock
        self.ids = itertools.count(1)  # connections, calls and streams
        self._handlers: dict[type[Any], Callable[[Any], None]] = {}
        self._queue: deque[object] = deque()  # inputs: dp's (`Input`) and any front end's
        self._feeding = False
        self._answers: dict[int, CallAnswer | None] = {}  # call -> its answer, while awaited
        self._after: list[Callable[[], None]] = []

    def now(self) -> float:
        return self._clock()

    # -- what the sub-systems register -------------------------------------------

    def on(self, kind: type[Any], handler: Callable[[Any], None]) -> None:
        """`handler` carries out every effect of `kind`; one handler per kind."""
        if kind in self._handlers:
            raise ValueError(f"{kind.__name__} has a handler already")
        self._handlers[kind] = handler

    def answers(self, *kinds: type[Any]) -> None:
        """Effects of `kinds` answer a call: `call` returns them to its caller."""
        for kind in kinds:
            self.on(kind, self._answered)

    def handles(self, kind: type[Any]) -> bool:
        return kind in self._handlers

    def after_input(self, hook: Callable[[], None]) -> None:
        """`hook` runs after each input's effects have been carried out."""
        self._after.append(hook)

    # -- feeding the core ----------------------------------------------------------

    def feed(self, event: object) -> None:
        """Hand `event` to the core and carry out its effects; fed while another
        input's effects run, it waits its turn (see the module's docstring)."""
        self._queue.append(event)
        if self._feeding:
            return
        self._feeding = True
        try:
            queue, handlers, node = self._queue, self._handlers, self.node
            while queue:
                effects = node.handle(queue.popleft())
                for effect in effects:
                    handlers[type(effect)](effect)
                for hook in self._after:
                    hook()
        finally:
            self._feeding = False

    def call(self, make: Callable[[int], object]) -> Any:
        """Feed the input `make(call)` builds for a new call number; its answer
        (None: the core gave none)."""
        call = next(self.ids)
        return self._answer(call, make(call))

    def resume(self, call: int, event: object) -> Any:
        """Feed `event`, which continues call number `call` (a `call` made
        before, answered by an effect that asks for more); the call's next
        answer (None: the core gave none)."""
        return self._answer(call, event)

    def _answer(self, call: int, event: object) -> Any:
        if self._feeding:
            # Its answer would come after the current input's effects, not
            # before this returns.
            raise RuntimeError("a call cannot be made or resumed while an input is being handled")
        self._answers[call] = None
        try:
            self.feed(event)
            return self._answers[call]
        finally:
            del self._answers[call]

    def _answered(self, effect: CallAnswer) -> None:
        if effect.call in self._answers:
            self._answers[effect.call] = effect
