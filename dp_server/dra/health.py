"""The kubelet's DRA health stream, `DRAResourceHealth/NodeWatchResources`, in both
of the kubelet's versions: `v1alpha1` (what a 1.36 kubelet opens, on every DRA
plugin) and `v1` (what a 1.37 kubelet opens on a plugin that advertises it,
falling back to `v1alpha1` for one that advertises that alone;
kubernetes/kubernetes#139477). The two have the same messages.

One handler per version: it opens a watch with whoever keeps the devices'
health (the runtime, through the core's one `HealthWatch`, which holds every
open stream of either version alike) and sends each report it is given, as
long as the kubelet keeps the stream. What is sent, and when, is the core's;
`health_message` only turns a report into the version's message.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any, Protocol

import attrs
import grpclib.const
import grpclib.server
from grpclib.const import Cardinality

from dp_core import Health, PublishHealth
from dp_server.proto import v1, v1alpha1
from dp_server.rpc import read_request

__all__ = [
    "HEALTH_APIS",
    "HEALTH_SERVICES",
    "MESSAGE_MAX",
    "DraHealthService",
    "HealthReport",
    "HealthWatcher",
    "health_message",
]

#: Each version's generated module, newest first; what registration advertises
#: for each is "<version>.DRAResourceHealth" (`HEALTH_SERVICES`), as the Go
#: helper (kubeletplugin) does.
HEALTH_APIS: dict[str, ModuleType] = {"v1": v1, "v1alpha1": v1alpha1}
HEALTH_SERVICES = tuple(f"{version}.DRAResourceHealth" for version in HEALTH_APIS)
#: The API's limit on a device's message; the kubelet cuts longer ones so too.
MESSAGE_MAX = 1024


@attrs.frozen
class HealthReport:
    """One list for one stream: the core's `effect`, its health determined at
    `unix_at` (Unix seconds, as the kubelet reads `last_updated_time`)."""

    effect: PublishHealth
    unix_at: int


class HealthWatcher(Protocol):
    def watch_health(self) -> contextlib.AbstractAsyncContextManager[AsyncIterator[Any]]:
        """A health stream for as long as the caller keeps it: each `HealthReport` to send."""


def _cut(message: str) -> str:
    return message if len(message) <= MESSAGE_MAX else message[: MESSAGE_MAX - 3] + "..."


def health_message(report: HealthReport, version: str = "v1") -> Any:
    """The kubelet's `NodeWatchResourcesResponse` of `version` for `report`.

    `health_check_timeout_seconds` is the core's `valid_for`: how long the
    kubelet is to hold each device's health before it reads Unknown, which
    outlasts two lost resends. `message` says why a device is not healthy
    ("" when it is)."""
    pb = HEALTH_APIS[version]
    effect = report.effect
    return pb.NodeWatchResourcesResponse(
        devices=[
            pb.DeviceHealth(
                device=pb.DeviceIdentifier(pool_name=device.pool, device_name=device.device),
                health=getattr(pb.HealthStatus, _STATUS[device.health]),
                last_updated_time=report.unix_at,
                health_check_timeout_seconds=effect.valid_for,
                message=_cut(device.message),
            )
            for device in effect.devices
        ]
    )


_STATUS = {Health.UNKNOWN: "UNKNOWN", Health.HEALTHY: "HEALTHY", Health.UNHEALTHY: "UNHEALTHY"}


class DraHealthService:
    """`NodeWatchResources` of `version` ("v1" or "v1alpha1"), served from `watcher`."""

    def __init__(self, watcher: HealthWatcher, version: str) -> None:
        if version not in HEALTH_APIS:
            raise ValueError(f"no DRA health API {version!r}; known: {list(HEALTH_APIS)}")
        self._watcher = watcher
        self.version = version

    async def node_watch_resources(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await read_request(stream)
        async with self._watcher.watch_health() as reports:
            async for report in reports:
                await stream.send_message(health_message(report, self.version))

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        pb = HEALTH_APIS[self.version]
        return {
            f"/{self.version}.DRAResourceHealth/NodeWatchResources": grpclib.const.Handler(
                self.node_watch_resources,
                Cardinality.UNARY_STREAM,
                pb.NodeWatchResourcesRequest,
                pb.NodeWatchResourcesResponse,
            )
        }
