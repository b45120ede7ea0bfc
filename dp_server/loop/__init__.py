"""The loop's core: one way into the core (`Loop`: inputs queued, effects to
the handler each sub-system registered, answers to their callers), the
timers that wake the server, its background tasks, when the garbage
collector runs, and what a front end's wiring is to the server
(`FrontendRuntime`). Every sub-system is wired onto it; it knows none of them."""

from dp_server.loop.core import CallAnswer, Loop
from dp_server.loop.frontend import FrontendLost, FrontendRuntime, Readiness, Services, Spawn
from dp_server.loop.memory import CollectionPolicy
from dp_server.loop.tasks import Tasks
from dp_server.loop.timers import CallbackTimer, Timer, TimerLoop

__all__ = [
    "CallAnswer",
    "CallbackTimer",
    "CollectionPolicy",
    "FrontendLost",
    "FrontendRuntime",
    "Loop",
    "Readiness",
    "Services",
    "Spawn",
    "Tasks",
    "Timer",
    "TimerLoop",
]
