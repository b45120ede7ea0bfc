"""What the status endpoint reads from the server it reports on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dp_core import Node
from dp_server.loop import FrontendRuntime

__all__ = ["ServerView"]


class ServerView(Protocol):
    """The serving process as /metrics, /healthz and /readyz see it.

    The runtime satisfies it; monitoring never imports the runtime, and asks
    every front end alike (`FrontendRuntime`: its readiness, its remarks,
    its families).
    """

    node: Node
    last_rescan: tuple[float, float] | None  # (when, seconds it took) of the last good scan
    rescan_failures: int  # host scans that raised, since start

    @property
    def frontends(self) -> Sequence[FrontendRuntime]:
        """Every front end the server runs, in the node's order."""
        ...

    def now(self) -> float:
        """The clock `last_rescan` was read on."""
        ...

    def timer_stopped(self) -> bool:
        """Whether the loop that drives rescans, ticks and re-registrations has ended."""
        ...

    def essential_tasks(self) -> dict[str, str]:
        """Each task dp cannot work without, by name -> why it ended ("" while it runs)."""
        ...
