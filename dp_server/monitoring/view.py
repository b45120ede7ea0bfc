"""What the status endpoint reads from the server it reports on."""

from __future__ import annotations

from typing import Protocol

from dp_core import Node

__all__ = ["ServerView"]


class ServerView(Protocol):
    """The serving process as /metrics, /healthz and /readyz see it.

    The runtime satisfies it; monitoring never imports the runtime.
    """

    node: Node
    last_rescan: tuple[float, float] | None  # (when, seconds it took) of the last good scan
    rescan_failures: int  # host scans that raised, since start

    def now(self) -> float:
        """The clock `last_rescan` was read on."""
        ...

    def timer_stopped(self) -> bool:
        """Whether the loop that drives rescans, ticks and re-registrations has ended."""
        ...
