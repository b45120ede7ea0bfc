"""What the inventory is made of: resources, each with its devices and its
front end, and the devices that were seen and not advertised."""

from __future__ import annotations

import attrs

from ..config.config import DEVICE_PLUGIN, FrontendName
from .advertised import AdvertisedDevice, SkippedDevice
from .classes import CLASSES, DeviceClass, DeviceKind

__all__ = ["Inventory", "Resource"]


@attrs.frozen
class Resource:
    """One resource: its devices, all of one kind, offered by one front end
    (the config entry's `frontend`)."""

    name: str
    kind: DeviceKind
    devices: tuple[AdvertisedDevice, ...]
    permissions: str = "rw"
    frontend: FrontendName = attrs.field(default=DEVICE_PLUGIN, kw_only=True)
    # Its class's row, looked up once: an Allocate reads it.
    device_class: DeviceClass = attrs.field(
        init=False,
        eq=False,
        repr=False,
        default=attrs.Factory(lambda self: CLASSES[self.kind], takes_self=True),
    )

    def device(self, device_id: str) -> AdvertisedDevice | None:
        for device in self.devices:
            if device.id == device_id:
                return device
        return None

    @property
    def healthy_count(self) -> int:
        return sum(1 for device in self.devices if device.healthy)


@attrs.frozen
class Inventory:
    """Every front end's resources, sorted by name, each labelled with its front
    end; and what the device-plugin API is not given, and why (a device another
    front end offers among them, so that `dp-server scan` says where it went)."""

    resources: tuple[Resource, ...] = ()
    skipped: tuple[SkippedDevice, ...] = ()

    def resource(self, name: str) -> Resource | None:
        for resource in self.resources:
            if resource.name == name:
                return resource
        return None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(resource.name for resource in self.resources)

    def offered_by(self, frontend: FrontendName) -> Inventory:
        """The resources `frontend` offers, with the same skipped devices."""
        if all(resource.frontend == frontend for resource in self.resources):
            return self
        mine = tuple(resource for resource in self.resources if resource.frontend == frontend)
        return Inventory(mine, self.skipped)
