"""What a change in a resource's device list says about health, as effects."""

from __future__ import annotations

from collections.abc import Sequence

from ..inventory.advertised import AdvertisedDevice
from ..log import Log
from .effects import HealthChanged

__all__ = ["health_changes"]

# Device IDs a health-changed line names; the count says how many there are.
_IDS_SHOWN = 3


def health_changes(
    resource: str,
    before: Sequence[AdvertisedDevice],
    after: Sequence[AdvertisedDevice],
) -> list[HealthChanged | Log]:
    """A `HealthChanged` for each device whose health changed, and a log line
    for each health and reason they changed to, with how many devices.

    A host without /dev/vhost-net turns 110 devices Unhealthy for one reason:
    that is one line, not 110. A new device counts as a change only when it
    arrives unhealthy: a healthy one is what the kubelet assumes of anything
    new in the list.
    """
    old = {d.id: d for d in before}
    effects: list[HealthChanged | Log] = []
    changed: dict[tuple[bool, str], list[str]] = {}
    for device in after:
        was = old.get(device.id)
        if was is not None and was.healthy == device.healthy:
            continue
        if was is None and device.healthy:
            continue
        effects.append(HealthChanged(resource, device.id, device.healthy, device.reason))
        changed.setdefault((device.healthy, device.reason), []).append(device.id)
    for (healthy, reason), ids in changed.items():
        shown = ", ".join(ids[:_IDS_SHOWN]) + (", ..." if len(ids) > _IDS_SHOWN else "")
        fields = (
            ("resource", resource),
            ("health", "Healthy" if healthy else "Unhealthy"),
            ("devices", len(ids)),
            ("ids", shown),
            ("reason", reason),
        )
        effects.append(Log("info" if healthy else "warning", "health-changed", fields))
    return effects
