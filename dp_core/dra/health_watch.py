"""What the kubelet's DRA health streams are sent, and when (KEP-4680).

A 1.36 kubelet with `ResourceHealthStatus` opens `NodeWatchResources` on a
DRA plugin when it registers it, and again 5 s after the stream ends for any
reason. Each message it reads is taken as the whole list of the driver's
devices: an entry per `pool/device` is kept with its time, and a device left
out, or not heard of for longer than its `health_check_timeout_seconds`
(30 s when not given), reads Unknown. When the stream ends the kubelet
forgets the driver's entries. Whenever it writes a pod's status, the health
of each device the pod's claims hold goes into the containers'
`allocatedResourcesStatus`; a change of health makes it write the status of
the pods holding the device at once.

So every stream is sent the whole list (`device_health`):

- when it opens, so the kubelet knows every device from the first message;
- whenever any device's health changes, to every stream at once;
- and again `resend` seconds after it was last sent, so that a device whose
  health stays the same never reads Unknown. dp watches the host all along,
  so each message says its health was determined when it is sent, and asks
  the kubelet to hold it for three times `resend`, and one second more, as
  the time goes on the wire in whole seconds, rounded down: two lost or late
  resends are tolerated, a dp that stopped sending shows as Unknown.

A device's health is what the DRA catalogue says of it (`build_inventory`'s
rules: its whole IOMMU group viable for VFIO, its /dev/vfio node there),
with the reason as the message. A device whose group another holder has is
still Healthy: that is for the pool (a taint), not the health of the device
a pod holds. A device a prepared claim holds that is no longer offered is
Unhealthy when it is gone from the host, and Unknown when it is there but
the config no longer selects it, as dp no longer watches it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from ..errors import UsageError
from ..host.pci import PciAddress
from ..host.snapshot import HostSnapshot
from ..log import Log
from .effects import PublishHealth
from .health import DeviceHealth, Health
from .inputs import HealthWatchEnded, HealthWatchStarted
from .pool import DraDevice
from .prepared import ClaimDevice, PreparedClaim

__all__ = ["HOLD_FACTOR", "HealthWatch", "device_health"]

#: The kubelet holds each message for this many resend intervals (and a second).
HOLD_FACTOR = 3


def device_health(
    devices: Iterable[DraDevice],
    prepared: Iterable[PreparedClaim],
    snapshot: HostSnapshot,
    pool: str,
) -> tuple[DeviceHealth, ...]:
    """The health of every device of the pool: those offered, and those held
    by a prepared claim and offered no longer (module docstring); by name."""
    found: dict[str, DeviceHealth] = {}
    for device in devices:
        advertised = device.advertised
        if advertised.healthy:
            found[device.name] = DeviceHealth(pool, device.name, Health.HEALTHY)
        else:
            message = advertised.reason or "unhealthy"
            found[device.name] = DeviceHealth(pool, device.name, Health.UNHEALTHY, message)
    for claim in prepared:
        for held in claim.devices:
            if held.name in found or held.pool != pool:
                continue
            if _on_host(held, snapshot):
                health, message = (
                    Health.UNKNOWN,
                    (f"{held.device_id} is no longer offered: the config does not select it"),
                )
            else:
                health, message = Health.UNHEALTHY, f"{held.device_id} is gone from the host"
            found[held.name] = DeviceHealth(pool, held.name, health, message)
    return tuple(found[name] for name in sorted(found))


def _on_host(device: ClaimDevice, snapshot: HostSnapshot) -> bool:
    try:
        address = PciAddress.parse(device.device_id)
    except ValueError:
        return any(mdev.uuid == device.device_id for mdev in snapshot.mdevs)
    return snapshot.device(address) is not None


def _changes(before: Sequence[DeviceHealth], after: Sequence[DeviceHealth]) -> list[Log]:
    """A log line per device whose health changed; a new device only when not healthy."""
    old = {(d.pool, d.device): d.health for d in before}
    logs = []
    for device in after:
        was = old.get((device.pool, device.device))
        if was is device.health or (was is None and device.health is Health.HEALTHY):
            continue
        level = "info" if device.health is Health.HEALTHY else "warning"
        fields = (
            ("device", device.device),
            ("health", device.health.value),
            ("reason", device.message),
        )
        logs.append(Log(level, "dra-health-changed", fields))
    return logs


class HealthWatch:
    """The open health streams, and the list they are sent (module docstring)."""

    def __init__(self, resend: float) -> None:
        if not resend > 0:
            raise UsageError(f"health resend interval must be positive, not {resend!r}")
        self.resend = resend
        self.valid_for = math.ceil(HOLD_FACTOR * resend) + 1
        self.devices: tuple[DeviceHealth, ...] = ()
        self._due: dict[int, float] = {}  # stream -> when it is sent the list again

    def streams(self) -> tuple[int, ...]:
        return tuple(sorted(self._due))

    def next_deadline(self) -> float | None:
        """When a stream is next due its list, if nothing changes first."""
        return min(self._due.values(), default=None)

    def started(self, event: HealthWatchStarted) -> list[PublishHealth]:
        if event.stream in self._due:
            raise UsageError(f"health stream {event.stream} started twice")
        return [self._send(event.stream, event.now)]

    def ended(self, event: HealthWatchEnded) -> list[PublishHealth]:
        self._due.pop(event.stream, None)
        return []

    def observe(self, devices: tuple[DeviceHealth, ...], now: float) -> list[PublishHealth | Log]:
        """The devices' health now: on a change, logs and the list to every stream."""
        if devices == self.devices:
            return []
        effects: list[PublishHealth | Log] = []
        effects.extend(_changes(self.devices, devices))
        self.devices = devices
        effects.extend(self._send(stream, now) for stream in self.streams())
        return effects

    def tick(self, now: float) -> list[PublishHealth]:
        """The list again to every stream it is due on."""
        due = self._due
        if not due or min(due.values()) > now:
            return []
        return [self._send(stream, now) for stream in self.streams() if due[stream] <= now]

    def _send(self, stream: int, now: float) -> PublishHealth:
        self._due[stream] = now + self.resend
        return PublishHealth(stream, self.devices, now, self.valid_for)
