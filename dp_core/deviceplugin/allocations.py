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

from collections.abc import Hashable, Mapping, Sequence
from typing import overload

import attrs

from ..config.config import DEVICE_PLUGIN
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
    def key(self) -> Hashable:
        return ("allocation", self.serial)

    @property
    def frontend(self) -> str:
        return DEVICE_PLUGIN

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
    def key(self) -> Hashable:
        return _unlisted_key(self.group)

    @property
    def frontend(self) -> str:
        return DEVICE_PLUGIN

    @property
    def owner(self) -> str:
        return self.resource

    @property
    def groups(self) -> tuple[int, ...]:
        return (self.group,)

    def describe(self) -> str:
        return self.why


def _unlisted_key(group: int) -> Hashable:
    return ("unlisted", group)


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
    """The device plugin's holds on the ledger: live allocations, and the
    groups held while the kubelet syncs.

    Each hold is booked once, in the ledger; the book derives its answers
    from it, with one index by device so that an Allocate costs the same
    with ten allocations in force as with ten thousand.
    """

    def __init__(self, ledger: Ledger, release_grace: float = 30.0) -> None:
        self._ledger = ledger
        # A pod that was just admitted may not be listed by PodResources yet.
        self.release_grace = release_grace
        # resource -> device ID -> the serial of the allocation holding it.
        # Thousands of allocations may be held, so no per-entry key tuple:
        # nested dicts share the resource's name.
        self._by_device: dict[str, dict[str, int]] = {}
        self._serial = 0
        # serial -> the allocation, oldest first: its holds in the ledger, in the
        # order they were booked (asked after every input: the poll's schedule).
        self._by_serial: dict[int, Allocation] = {}

    def __len__(self) -> int:
        return len(self._by_serial)

    def all(self) -> tuple[Allocation, ...]:
        """Every live allocation, oldest first."""
        return tuple(self._by_serial.values())

    def conflict(self, resource: str, devices: Sequence[AdvertisedDevice]) -> str | None:
        """Why giving `devices` to one container would split a held group."""
        refusal = self._ledger.refusal(
            resource, ((d.id, d.iommu_group) for d in devices), takes_over=True
        )
        if refusal is None:
            return None
        return f"{refusal}; VFIO cannot split a group between containers"

    def record(
        self, resource: str, devices: Sequence[AdvertisedDevice], now: float
    ) -> tuple[Allocation, tuple[Allocation, ...]]:
        """Record an allocation, replacing any older one of the same devices;
        returns it and the allocations it replaced.

        The kubelet only hands out devices it considers free, so an older
        allocation naming one of them belongs to a container that is gone.
        """
        ids = tuple(device.id for device in devices)
        replaced = {
            serial
            for device_id in ids
            if (serial := self._by_device.get(resource, {}).get(device_id)) is not None
        }
        gone = tuple(self._remove(self._by_serial[serial]) for serial in sorted(replaced))
        self._serial += 1
        groups = tuple(sorted({d.iommu_group for d in devices if d.iommu_group is not None}))
        allocation = Allocation(self._serial, resource, ids, groups, now)
        if groups:
            for group in groups:
                # The kubelet gave a device the hold names: it holds it no more.
                self.release_unlisted(group)
            self._ledger.hold(allocation)
            self._by_serial[allocation.serial] = allocation
            by_id = self._by_device.setdefault(resource, {})
            for device_id in ids:
                by_id[device_id] = allocation.serial
        return allocation, gone

    def _remove(self, allocation: Allocation) -> Allocation:
        self._ledger.release(allocation)
        del self._by_serial[allocation.serial]
        by_id = self._by_device.get(allocation.resource, {})
        for device_id in allocation.device_ids:
            if by_id.get(device_id) == allocation.serial:
                del by_id[device_id]
        return allocation

    def release_unheld(self, held: Mapping[str, frozenset[str]], now: float) -> list[Allocation]:
        """Drop allocations none of whose devices any active pod holds."""
        released = []
        for allocation in list(self._by_serial.values()):
            if now - allocation.at < self.release_grace:
                break  # oldest first: every later one is younger still
            still_held = held.get(allocation.resource, frozenset())
            if still_held.isdisjoint(allocation.device_ids):
                released.append(self._remove(allocation))
        return released

    def adopt(
        self, resource: str, devices: Sequence[AdvertisedDevice], now: float
    ) -> tuple[list[Allocation], list[str]]:
        """Hold the groups of held `devices` that no allocation here records.

        The PodResources API says a running pod holds them, but this book does
        not know it: dp restarted since the pod was admitted. Unheld, their
        groups' siblings would be handed to the next VM. One allocation per
        group; a group another holder has is split already, and is
        reported (`Ledger.split_report`, second list) rather than papered over.
        """
        by_device = self._by_device.get(resource, {})
        by_group: dict[int, list[AdvertisedDevice]] = {}
        for device in devices:
            if device.iommu_group is not None and device.id not in by_device:
                by_group.setdefault(device.iommu_group, []).append(device)
        adopted, split = [], []
        for group, members in sorted(by_group.items()):
            self.release_unlisted(group)  # the pod it was held for is listed now
            ids = ", ".join(device.id for device in members)
            report = self._ledger.split_report(group, f"a pod holds {ids} of {resource}")
            if report is not None:
                split.append(report)
                continue
            adopted.append(self.record(resource, members, now)[0])
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
        self._ledger.hold(hold)
        return hold

    def release_unlisted(self, group: int) -> UnlistedHold | None:
        hold = self._ledger.holding(_unlisted_key(group))
        if not isinstance(hold, UnlistedHold):
            return None
        self._ledger.release(hold)
        return hold

    def unlisted_holds(self) -> Mapping[int, UnlistedHold]:
        """Group -> its hold while the kubelet syncs."""
        return {h.group: h for h in self._ledger.holders() if isinstance(h, UnlistedHold)}

    def next_release_check(self) -> float | None:
        for oldest in self._by_serial.values():
            return oldest.at + self.release_grace
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
