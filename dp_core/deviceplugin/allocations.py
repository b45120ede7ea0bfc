"""The device-plugin front end's holds on the ledger: allocations, and groups
held while the kubelet syncs.

VFIO hands a whole IOMMU group to one user (docs/design.md §5). An allocation
therefore holds every group it touches until the PodResources API shows
that no active pod holds its devices any more; the hold is what makes
siblings Unhealthy and what refuses an Allocate that would split a group.
`AllocationBook` keeps them, indexed for the device plugin's questions, and
puts each into the node's one `Ledger`, which holds DRA's claims too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import overload

import attrs

from ..errors import UsageError
from ..inventory.advertised import AdvertisedDevice
from ..ledger import Holder, Ledger, holds
from ..log import Log

__all__ = [
    "Allocation",
    "AllocationBook",
    "UnlistedHold",
    "allocation_log",
    "as_advertised",
]


@attrs.frozen
class Allocation:
    """Devices of `resource` an Allocate gave one container (or PodResources
    showed a pod holds); it holds their IOMMU groups."""

    serial: int
    resource: str
    device_ids: tuple[str, ...]
    groups: tuple[int, ...]  # sorted, each once
    at: float

    @property
    def owner(self) -> str:
        return self.resource

    def describe(self) -> str:
        return f"allocation #{self.serial} of {self.resource} ({', '.join(self.device_ids)})"


@attrs.frozen
class UnlistedHold:
    """A group held while the kubelet syncs (`sync`): a pod it has not listed
    yet may hold `device_ids` of `resource` in it, as `why` says."""

    group: int
    resource: str
    device_ids: tuple[str, ...]
    why: str
    at: float

    @property
    def owner(self) -> str:
        return self.resource

    @property
    def groups(self) -> tuple[int, ...]:
        return (self.group,)

    def describe(self) -> str:
        return self.why


def allocation_log(event: str, allocation: Allocation) -> Log:
    """The log line of an allocation made, adopted or released."""
    return Log("info", event, _AllocationFields(allocation))


class _AllocationFields(Sequence[tuple[str, object]]):
    """An allocation's log fields, rendered when they are read.

    One PodResources answer can release thousands of allocations at once (a
    node's pods ending together), one log line each. Rendered up front, the
    fields of 2,064 such lines took 0.6 MB at the peak of that batch, which
    the process kept as resident memory; this holds the allocation alone.
    """

    __slots__ = ("_allocation",)

    def __init__(self, allocation: Allocation) -> None:
        self._allocation = allocation

    def _pairs(self) -> tuple[tuple[str, object], ...]:
        allocation = self._allocation
        return (
            ("resource", allocation.resource),
            ("devices", ",".join(allocation.device_ids)),
            ("groups", ",".join(str(g) for g in allocation.groups)),
        )

    @overload
    def __getitem__(self, index: int) -> tuple[str, object]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[tuple[str, object]]: ...

    def __getitem__(self, index: int | slice) -> tuple[str, object] | Sequence[tuple[str, object]]:
        return self._pairs()[index]

    def __len__(self) -> int:
        return 3

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return self._pairs() == tuple(other)

    def __hash__(self) -> int:
        return hash(self._pairs())

    def __repr__(self) -> str:
        return repr(self._pairs())


class AllocationBook:
    """Live allocations and the groups held while the kubelet syncs.

    Indexed by device so that an Allocate costs the same with ten
    allocations in force as with ten thousand.
    """

    def __init__(self, ledger: Ledger, release_grace: float = 30.0) -> None:
        self._ledger = ledger
        # A pod that was just admitted may not be listed by PodResources yet.
        self.release_grace = release_grace
        self._allocations: dict[int, Allocation] = {}  # by serial, oldest first
        # resource -> device ID -> serial. Thousands of allocations may be held,
        # so no per-entry key tuple: nested dicts share the resource's name.
        self._by_device: dict[str, dict[str, int]] = {}
        self._serial = 0
        self.last_replaced: tuple[Allocation, ...] = ()
        # Groups held while the kubelet syncs, by group (sync): a pod it has
        # not listed yet may hold them. An Allocate or a PodResources answer
        # naming one of the held devices takes the group over.
        self._unlisted: dict[int, UnlistedHold] = {}

    def __len__(self) -> int:
        return len(self._allocations)

    def all(self) -> tuple[Allocation, ...]:
        return tuple(self._allocations.values())

    def conflict(self, resource: str, devices: Sequence[AdvertisedDevice]) -> str | None:
        """Why giving `devices` to one container would split a held group."""
        wanted = {device.id for device in devices}
        ledger = self._ledger
        for device in devices:
            if device.iommu_group is None:
                continue
            holder = ledger.holder(device.iommu_group)
            if holder is None:
                continue
            same_owner = holder.owner == resource and wanted & set(holder.device_ids)
            if not same_owner:
                return (
                    f"IOMMU group {device.iommu_group} of device {device.id} is held by "
                    f"{holder.describe()}; VFIO cannot split a group between containers"
                )
        return None

    def record(self, resource: str, devices: Sequence[AdvertisedDevice], now: float) -> Allocation:
        """Record an allocation, replacing any older one of the same devices.

        The kubelet only hands out devices it considers free, so an older
        allocation naming one of them belongs to a container that is gone.
        The replaced allocations are left in `last_replaced`.
        """
        ids = tuple(device.id for device in devices)
        replaced = {
            serial
            for device_id in ids
            if (serial := self._by_device.get(resource, {}).get(device_id)) is not None
        }
        self.last_replaced = tuple(self._remove(serial) for serial in sorted(replaced))
        self._serial += 1
        groups = tuple(sorted({d.iommu_group for d in devices if d.iommu_group is not None}))
        allocation = Allocation(self._serial, resource, ids, groups, now)
        if groups:
            if self._unlisted:
                for group in groups:
                    # The kubelet gave a device the hold names: it holds it no more.
                    self.release_unlisted(group)
            self._ledger.hold(allocation)
            self._allocations[allocation.serial] = allocation
            for device_id in ids:
                self._by_device.setdefault(resource, {})[device_id] = allocation.serial
        return allocation

    def _remove(self, serial: int) -> Allocation:
        allocation = self._allocations.pop(serial)
        self._ledger.release(allocation)
        for device_id in allocation.device_ids:
            by_id = self._by_device.get(allocation.resource, {})
            if by_id.get(device_id) == serial:
                del by_id[device_id]
        return allocation

    def release_unheld(self, held: Mapping[str, frozenset[str]], now: float) -> list[Allocation]:
        """Drop allocations none of whose devices any active pod holds."""
        released = []
        for serial, allocation in list(self._allocations.items()):
            if now - allocation.at < self.release_grace:
                break  # oldest first: every later one is younger still
            still_held = held.get(allocation.resource, frozenset())
            if not still_held & set(allocation.device_ids):
                released.append(self._remove(serial))
        return released

    def adopt(
        self, resource: str, devices: Sequence[AdvertisedDevice], now: float
    ) -> tuple[list[Allocation], list[str]]:
        """Hold the groups of held `devices` that no allocation here records.

        The PodResources API says a running pod holds them, but this book does
        not know it: dp restarted since the pod was admitted. Unheld, their
        groups' siblings would be handed to the next VM. One allocation per
        group; a group another holder has is split already, and is
        reported (second list) rather than papered over.
        """
        by_device = self._by_device.get(resource, {})
        by_group: dict[int, list[AdvertisedDevice]] = {}
        for device in devices:
            if device.iommu_group is not None and device.id not in by_device:
                by_group.setdefault(device.iommu_group, []).append(device)
        adopted, split = [], []
        for group, members in sorted(by_group.items()):
            holder = self._ledger.holder(group)
            if holder is not None and holder is self._unlisted.get(group):
                self.release_unlisted(group)  # the pod it was held for is listed now
                holder = None
            if holder is not None:
                ids = ", ".join(device.id for device in members)
                split.append(
                    f"IOMMU group {group} is split: a pod holds {ids} of {resource}, "
                    f"and {holder.describe()} holds the group"
                )
                continue
            adopted.append(self.record(resource, members, now))
        return adopted, split

    def hold_unlisted(
        self, group: int, resource: str, device_ids: Sequence[str], why: str, now: float
    ) -> UnlistedHold:
        """Hold `group` for a pod the kubelet has not listed yet; the caller
        has checked that nothing holds it. `device_ids` of `resource` are the
        devices the pod may hold, which stay as they are; `why` describes it."""
        if self._ledger.holder(group) is not None:
            raise UsageError(f"IOMMU group {group} cannot be held as unlisted: held already")
        hold = UnlistedHold(group, resource, tuple(device_ids), why, now)
        self._unlisted[group] = hold
        self._ledger.hold(hold)
        return hold

    def release_unlisted(self, group: int) -> UnlistedHold | None:
        hold = self._unlisted.pop(group, None)
        if hold is not None:
            self._ledger.release(hold)
        return hold

    def unlisted_holds(self) -> Mapping[int, UnlistedHold]:
        """Group -> its hold while the kubelet syncs; a read-only view."""
        return MappingProxyType(self._unlisted)

    def next_release_check(self) -> float | None:
        for allocation in self._allocations.values():
            return allocation.at + self.release_grace
        return None


def as_advertised(
    resource: str, device: AdvertisedDevice, reserved: Mapping[int, Holder]
) -> AdvertisedDevice:
    """`device` as `resource` advertises it while `reserved` groups are held."""
    holder = reserved.get(device.iommu_group) if device.iommu_group is not None else None
    if holder is None or not device.healthy:
        return device
    if holds(holder, resource, device.id):
        return device
    return attrs.evolve(
        device,
        healthy=False,
        reason=f"IOMMU group {device.iommu_group} is held by {holder.describe()}",
    )
