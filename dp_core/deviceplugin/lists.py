"""The device list each device-plugin resource advertises to the kubelet.

`DeviceLists` takes the device-plugin front end's part of the inventory at
every change of the world, and works out each resource's list again as the
ledger's holders change: a device whose IOMMU group another holder has is
advertised Unhealthy (`as_advertised`). Only what changed is reported, so
that the front end publishes only those lists; after a change of holders
only the members of the groups it touched are looked at (an Allocate must
not cost a walk of every device it shares a resource with).
"""

from __future__ import annotations

from collections.abc import Iterable, KeysView, Mapping

import attrs

from ..config.config import DEVICE_PLUGIN
from ..inventory.advertised import AdvertisedDevice
from ..inventory.build import shared_groups
from ..inventory.resources import Inventory, Resource
from ..ledger import Holder
from .allocations import as_advertised

__all__ = ["Change", "DeviceLists", "advertised_list"]

Devices = tuple[AdvertisedDevice, ...]
#: A resource whose list changed: its name, the list before and the list now.
Change = tuple[str, Devices, Devices]


def advertised_list(resource: Resource, reserved: Mapping[int, Holder]) -> Devices:
    """`resource`'s list as the kubelet is to see it while `reserved` groups are held."""
    if not reserved or not resource.device_class.vfio:
        return resource.devices
    return tuple(as_advertised(resource.name, device, reserved) for device in resource.devices)


class DeviceLists:
    """Each resource's advertised list, given the ledger's `held` view."""

    def __init__(self, held: Mapping[int, Holder]) -> None:
        self._held = held
        self.offered = Inventory()  # its part of the world's inventory, as last told
        self._by_name: dict[str, Resource] = {}
        self._inventory_ids: dict[str, dict[str, AdvertisedDevice]] = {}
        self._published: dict[str, Devices] = {}
        self._published_ids: dict[str, dict[str, AdvertisedDevice]] = {}
        # IOMMU group -> (resource, position in its device list) of every member,
        # for groups of two or more members only: an allocation can change how
        # a device is advertised only through a sibling holding its group.
        self._group_members: dict[int, list[tuple[str, int]]] = {}

    def take(self, inventory: Inventory) -> None:
        """The world's inventory, of which it advertises the device plugin's part."""
        offered = self.offered = inventory.offered_by(DEVICE_PLUGIN)
        self._by_name = {r.name: r for r in offered.resources}
        self._inventory_ids = {r.name: {d.id: d for d in r.devices} for r in offered.resources}
        # A sibling another front end offers has a holder that changes how
        # a member here is advertised, even alone in its group here.
        elsewhere = {
            device.iommu_group
            for resource in inventory.resources
            if resource.frontend != DEVICE_PLUGIN
            for device in resource.devices
            if device.iommu_group is not None
        }
        self._group_members = shared_groups(offered.resources, also=elsewhere)

    # -- what it tells -------------------------------------------------------------

    def resource(self, name: str) -> Resource | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        """Every resource it offers or has published: one whose devices all
        vanished stays registered with an empty list (the kubelet has no way
        to unregister one)."""
        return sorted({*self._by_name, *self._published})

    def published(self) -> KeysView[str]:
        return self._published.keys()

    def advertised(self, name: str, default: Devices = ()) -> Devices:
        """The list last published for `name` (`default` if none was)."""
        return self._published.get(name, default)

    def published_ids(self, name: str) -> Mapping[str, AdvertisedDevice]:
        return self._published_ids.get(name, {})

    def inventory_ids(self, name: str) -> Mapping[str, AdvertisedDevice]:
        """`name`'s devices by ID as the inventory has them (before holders)."""
        return self._inventory_ids.get(name, {})

    def shared_groups(self) -> KeysView[int]:
        return self._group_members.keys()

    def describe(self) -> Inventory:
        """Its part of the inventory with reservations applied, as last published."""
        offered = self.offered
        devices = [
            attrs.evolve(r, devices=self.advertised(r.name, r.devices)) for r in offered.resources
        ]
        return Inventory(tuple(devices), offered.skipped)

    # -- working the lists out again ----------------------------------------------

    def refresh(self, only: Iterable[str] | None = None) -> list[Change]:
        """Work out the lists of `only` these resources (or of every one) again;
        keep and return those that changed, in name order."""
        reserved = self._held
        by_name = self._by_name
        names = self.names() if only is None else [n for n in only if n in by_name]
        changes: list[Change] = []
        for name in sorted(names):
            resource = by_name.get(name)
            devices = advertised_list(resource, reserved) if resource is not None else ()
            previous = self._published.get(name)
            if previous == devices:
                continue
            changes.append((name, previous or (), devices))
            self._published[name] = devices
            self._published_ids[name] = {device.id: device for device in devices}
        return changes

    def refresh_groups(self, groups: Iterable[int]) -> list[Change]:
        """`refresh` for a change of the holders of `groups`: only their
        members' resources can change."""
        reserved = self._held
        changed = set()
        for group in groups:
            members = self._group_members.get(group)
            if members is None:
                holder = reserved.get(group)
                if holder is None or holder.owner in self._by_name:
                    continue  # alone in its group, and its own allocations leave it as it is
                # A holder of another front end's has a device alone in its group here.
                members = self._group_members[group] = self._members_of(group)
            for name, index in members:
                published = self._published.get(name, ())
                device = self._by_name[name].devices[index]
                if index >= len(published) or published[index] != as_advertised(
                    name, device, reserved
                ):
                    changed.add(name)
        return self.refresh(changed) if changed else []

    def _members_of(self, group: int) -> list[tuple[str, int]]:
        return [
            (name, index)
            for name, resource in self._by_name.items()
            for index, device in enumerate(resource.devices)
            if device.iommu_group == group
        ]
