"""What a change in a resource's device list says about health, as effects."""

from __future__ import annotations

from collections.abc import Sequence

from .advertised import AdvertisedDevice
from .effects import HealthChanged, Log

__all__ = ["health_changes"]


def health_changes(
    resource: str,
    before: Sequence[AdvertisedDevice],
    after: Sequence[AdvertisedDevice],
) -> list[HealthChanged | Log]:
    """A `HealthChanged` and a log line for each device whose health changed.

    A new device counts as a change only when it arrives unhealthy: a healthy
    one is what the kubelet assumes of anything new in the list.
    """
    old = {d.id: d for d in before}
    effects: list[HealthChanged | Log] = []
    for device in after:
        was = old.get(device.id)
        if was is not None and was.healthy == device.healthy:
            continue
        if was is None and device.healthy:
            continue
        effects.append(HealthChanged(resource, device.id, device.healthy, device.reason))
        level = "info" if device.healthy else "warning"
        fields = dict(resource=resource, device=device.id, health=device.health)
        effects.append(Log(level, "health-changed", (*fields.items(), ("reason", device.reason))))
    return effects
