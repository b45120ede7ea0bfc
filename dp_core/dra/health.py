"""A DRA device's health as the kubelet's health stream carries it (KEP-4680)."""

from __future__ import annotations

import enum

import attrs

__all__ = ["DeviceHealth", "Health"]


class Health(enum.Enum):
    """`HealthStatus` of k8s.io/kubelet's dra-health API; the values are what
    the kubelet writes into a pod's `allocatedResourcesStatus`."""

    UNKNOWN = "Unknown"
    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


@attrs.frozen
class DeviceHealth:
    """One device of the driver's pool `pool`, and why it is not healthy (`message`)."""

    pool: str
    device: str
    health: Health
    message: str = ""

    def __attrs_post_init__(self) -> None:
        if not self.pool or not self.device:
            raise ValueError(f"a device's health needs its pool and name: {self!r}")
        if self.health is Health.HEALTHY and self.message:
            raise ValueError(f"healthy device {self.device} with a problem: {self.message!r}")
