"""The kubelet's DRA health stream, `v1alpha1.DRAResourceHealth/NodeWatchResources`.

One handler: it opens a watch with whoever keeps the devices' health (the
runtime, through the core's `HealthWatch`) and sends each list it is given,
as long as the kubelet keeps the stream. What is sent, and when, is the
core's; `health_message` only turns a `PublishHealth` into the kubelet's
message.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpclib.const
import grpclib.server
from grpclib.const import Cardinality

from dp_core import Health, PublishHealth
from dp_server.proto import v1alpha1 as pb
from dp_server.rpc import read_request

__all__ = [
    "HEALTH_SERVICE",
    "MESSAGE_MAX",
    "DraHealthService",
    "HealthWatcher",
    "health_message",
]

#: What registration advertises for it, as the Go helper (kubeletplugin) does.
HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"
_PATH = "/v1alpha1.DRAResourceHealth/NodeWatchResources"
#: The API's limit on a device's message; the kubelet cuts longer ones so too.
MESSAGE_MAX = 1024

_STATUS = {
    Health.UNKNOWN: pb.HealthStatus.UNKNOWN,
    Health.HEALTHY: pb.HealthStatus.HEALTHY,
    Health.UNHEALTHY: pb.HealthStatus.UNHEALTHY,
}


class HealthWatcher(Protocol):
    def watch_health(self) -> contextlib.AbstractAsyncContextManager[AsyncIterator[Any]]:
        """A health stream for as long as the caller keeps it: each message to send."""


def _cut(message: str) -> str:
    return message if len(message) <= MESSAGE_MAX else message[: MESSAGE_MAX - 3] + "..."


def health_message(effect: PublishHealth, unix_at: int) -> pb.NodeWatchResourcesResponse:
    """The kubelet's message for `effect`, its health determined at `unix_at` (Unix seconds)."""
    return pb.NodeWatchResourcesResponse(
        devices=[
            pb.DeviceHealth(
                device=pb.DeviceIdentifier(pool_name=device.pool, device_name=device.device),
                health=_STATUS[device.health],
                last_updated_time=unix_at,
                health_check_timeout_seconds=effect.valid_for,
                message=_cut(device.message),
            )
            for device in effect.devices
        ]
    )


class DraHealthService:
    """`NodeWatchResources`, served from `watcher`."""

    def __init__(self, watcher: HealthWatcher) -> None:
        self._watcher = watcher

    async def node_watch_resources(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await read_request(stream)
        async with self._watcher.watch_health() as updates:
            async for message in updates:
                await stream.send_message(message)

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            _PATH: grpclib.const.Handler(
                self.node_watch_resources,
                Cardinality.UNARY_STREAM,
                pb.NodeWatchResourcesRequest,
                pb.NodeWatchResourcesResponse,
            )
        }
