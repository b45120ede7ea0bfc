"""What the status endpoint reads from the server it reports on."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from dp_core import MetricFamily, Node

__all__ = ["DraView", "ServerView"]


class DraView(Protocol):
    """The DRA front end, with the config's `dra`."""

    driver: str

    @property
    def ready(self) -> bool:
        """Its sockets are ours and the kubelet said it registered the driver."""
        ...

    def registration(self) -> tuple[bool, str] | None:
        """What the kubelet last said: (registered, error); None: nothing yet."""
        ...

    def families(self) -> Iterable[MetricFamily]:
        """Its metrics: API requests, the slice publisher's state, its files."""
        ...


class ServerView(Protocol):
    """The serving process as /metrics, /healthz and /readyz see it.

    The runtime satisfies it; monitoring never imports the runtime.
    """

    node: Node
    last_rescan: tuple[float, float] | None  # (when, seconds it took) of the last good scan
    rescan_failures: int  # host scans that raised, since start

    @property
    def dra(self) -> DraView | None:
        """The DRA front end; None without the config's `dra`."""
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
