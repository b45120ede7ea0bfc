"""The kubelet's ListAndWatch streams: which resource each serves, and what
each is sent.

A stream is opened on a connection attributed to a resource and gets that
resource's list at once, then every list that changes (`publish`). Those of
a resource registering again are ended first: a stream of an earlier
registration that ends after the new one would make the kubelet mark the new
endpoint unhealthy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..inventory.advertised import AdvertisedDevice
from ..log import Log
from .effects import EndStream, HealthChanged, Publish
from .health import health_changes
from .lists import Change

__all__ = ["Watches"]


class Watches:
    """Stream -> (connection, resource), for every stream the kubelet holds open."""

    def __init__(self) -> None:
        self._streams: dict[int, tuple[int, str]] = {}

    def opened(self, stream: int, connection: int, resource: str) -> None:
        self._streams[stream] = (connection, resource)

    def ended(self, stream: int) -> None:
        self._streams.pop(stream, None)

    def connection_closed(self, connection: int) -> None:
        for stream, (on, _) in list(self._streams.items()):
            if on == connection:
                del self._streams[stream]

    def of(self, resource: str) -> list[int]:
        return [stream for stream, (_, name) in self._streams.items() if name == resource]

    def end(self, resource: str, reason: str) -> list[EndStream]:
        """End every stream of `resource` (it registers again)."""
        ended = self.of(resource)
        for stream in ended:
            del self._streams[stream]
        return [EndStream(stream, reason) for stream in ended]

    def publish(self, changes: Iterable[Change]) -> list[Publish | HealthChanged | Log]:
        """What the kubelet hears of `changes`: each list on every stream of
        its resource, and the health changes logged."""
        effects: list[Publish | HealthChanged | Log] = []
        for name, previous, devices in changes:
            effects.extend(health_changes(name, previous, devices))
            for stream in self.of(name):
                effects.append(Publish(stream, name, devices))
        return effects

    def resend(
        self, first: str, advertised: Callable[[str], tuple[AdvertisedDevice, ...]]
    ) -> list[Publish]:
        """One list sent again on one stream, of resource `first` if it has one."""
        streams = sorted(self._streams.items(), key=lambda item: item[1][1] != first)
        for stream, (_, name) in streams:
            return [Publish(stream, name, advertised(name))]
        return []
