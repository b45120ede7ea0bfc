"""Allocations, IOMMU group reservations and preferred-allocation packing.

VFIO hands a whole IOMMU group to one user (docs/design.md §5). An allocation
therefore reserves every group it touches until the PodResources API shows
that no active pod holds its devices any more; the reservation is what makes
siblings Unhealthy and what refuses an Allocate that would split a group.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import overload

import attrs

from .advertised import AdvertisedDevice
from .answers import ContainerAllocation, DeviceSpec
from .claims import ClaimRef
from .effects import Log
from .errors import UsageError
from .inventory import DeviceKind, Resource
from .names import env_var_name

__all__ = [
    "Allocation",
    "AllocationBook",
    "allocation_log",
    "as_advertised",
    "container_allocation",
    "preferred_devices",
]

_ENV_PREFIX = {DeviceKind.PCI: "PCI_RESOURCE_", DeviceKind.MDEV: "MDEV_PCI_RESOURCE_"}


@attrs.frozen
class Allocation:
    serial: int
    resource: str
    device_ids: tuple[str, ...]
    groups: tuple[int, ...]  # sorted, each once
    at: float
    # Set for a DRA claim's hold: `resource` is then the driver and
    # `device_ids` the pool's device names (`AllocationBook.hold_claim`).
    claim: ClaimRef | None = attrs.field(default=None, kw_only=True)
    # Set for a group held while the kubelet syncs (`AllocationBook.hold_unlisted`):
    # who may hold it, as its description says.
    unlisted: str | None = attrs.field(default=None, kw_only=True)

    def describe(self) -> str:
        if self.unlisted is not None:
            return self.unlisted
        if self.claim is not None:
            claim = self.claim
            return f"claim {claim.namespace}/{claim.name} (UID {claim.uid})"
        return f"allocation #{self.serial} of {self.resource} ({', '.join(self.device_ids)})"


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
    """Live allocations and the IOMMU groups they reserve.

    Indexed by group and by device so that an Allocate costs the same with
    ten allocations in force as with ten thousand.
    """

    def __init__(self, release_grace: float = 30.0) -> None:
        # A pod that was just admitted may not be listed by PodResources yet.
        self.release_grace = release_grace
        self._allocations: dict[int, Allocation] = {}  # by serial, oldest first
        self._by_group: dict[int, Allocation] = {}
        # resource -> device ID -> serial. Thousands of allocations may be held,
        # so no per-entry key tuple: nested dicts share the resource's name.
        self._by_device: dict[str, dict[str, int]] = {}
        self._serial = 0
        self.last_replaced: tuple[Allocation, ...] = ()
        # DRA claims' holds, by claim UID: released by NodeUnprepareResources
        # alone, never by what PodResources says.
        self._claims: dict[str, Allocation] = {}
        # Groups held while the kubelet syncs, by group (kubelet_sync): a pod
        # it has not listed yet may hold them. An Allocate or a PodResources
        # answer naming one of the held devices takes the group over.
        self._unlisted: dict[int, Allocation] = {}

    def __len__(self) -> int:
        return len(self._allocations)

    def all(self) -> tuple[Allocation, ...]:
        return tuple(self._allocations.values())

    def group_holder(self, group: int) -> Allocation | None:
        return self._by_group.get(group)

    def reserved_groups(self) -> Mapping[int, Allocation]:
        """Group -> the allocation holding it; a read-only view."""
        return MappingProxyType(self._by_group)

    def conflict(self, resource: str, devices: Sequence[AdvertisedDevice]) -> str | None:
        """Why giving `devices` to one container would split a reserved group."""
        wanted = {device.id for device in devices}
        for device in devices:
            if device.iommu_group is None:
                continue
            holder = self._by_group.get(device.iommu_group)
            if holder is None:
                continue
            same_owner = holder.resource == resource and wanted & set(holder.device_ids)
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
            self._allocations[allocation.serial] = allocation
            for group in groups:
                # The kubelet gave a device the hold names: it holds it no more.
                self._unlisted.pop(group, None)
                self._by_group[group] = allocation
            for device_id in ids:
                self._by_device.setdefault(resource, {})[device_id] = allocation.serial
        return allocation

    def _remove(self, serial: int) -> Allocation:
        allocation = self._allocations.pop(serial)
        for group in allocation.groups:
            if self._by_group.get(group) is allocation:
                del self._by_group[group]
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
        """Reserve the groups of held `devices` that no allocation here records.

        The PodResources API says a running pod holds them, but this book does
        not know it: dp restarted since the pod was admitted. Unreserved, their
        groups' siblings would be handed to the next VM. One allocation per
        group; a group another allocation holds is split already, and is
        reported (second list) rather than papered over.
        """
        by_device = self._by_device.get(resource, {})
        by_group: dict[int, list[AdvertisedDevice]] = {}
        for device in devices:
            if device.iommu_group is not None and device.id not in by_device:
                by_group.setdefault(device.iommu_group, []).append(device)
        adopted, split = [], []
        for group, members in sorted(by_group.items()):
            holder = self._by_group.get(group)
            if holder is not None and holder.unlisted is not None:
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

    def hold_claim(
        self,
        claim: ClaimRef,
        driver: str,
        device_names: Sequence[str],
        groups: Sequence[int],
        now: float,
    ) -> Allocation:
        """Reserve `groups` for a DRA claim; the caller has checked that they are free."""
        wanted = tuple(sorted(set(groups)))
        taken = [g for g in wanted if g in self._by_group]
        if taken or claim.uid in self._claims:
            raise UsageError(f"claim {claim.uid} cannot hold IOMMU groups {taken}: held already")
        hold = Allocation(0, driver, tuple(device_names), wanted, now, claim=claim)
        self._claims[claim.uid] = hold
        for group in wanted:
            self._by_group[group] = hold
        return hold

    def release_claim(self, uid: str) -> Allocation | None:
        """Free a claim's groups at once; None when the claim holds nothing here."""
        hold = self._claims.pop(uid, None)
        if hold is not None:
            for group in hold.groups:
                if self._by_group.get(group) is hold:
                    del self._by_group[group]
        return hold

    def claim_holds(self) -> tuple[Allocation, ...]:
        return tuple(self._claims.values())

    def hold_unlisted(
        self, group: int, resource: str, device_ids: Sequence[str], why: str, now: float
    ) -> Allocation:
        """Hold `group` for a pod the kubelet has not listed yet; the caller
        has checked that nothing holds it. `device_ids` of `resource` are the
        devices the pod may hold, which stay as they are; `why` describes it."""
        if group in self._by_group:
            raise UsageError(f"IOMMU group {group} cannot be held as unlisted: held already")
        hold = Allocation(0, resource, tuple(device_ids), (group,), now, unlisted=why)
        self._unlisted[group] = hold
        self._by_group[group] = hold
        return hold

    def release_unlisted(self, group: int) -> Allocation | None:
        hold = self._unlisted.pop(group, None)
        if hold is not None and self._by_group.get(group) is hold:
            del self._by_group[group]
        return hold

    def unlisted_holds(self) -> Mapping[int, Allocation]:
        """Group -> its hold while the kubelet syncs; a read-only view."""
        return MappingProxyType(self._unlisted)

    def next_release_check(self) -> float | None:
        for allocation in self._allocations.values():
            return allocation.at + self.release_grace
        return None


def container_allocation(
    resource: Resource, devices: Sequence[AdvertisedDevice]
) -> ContainerAllocation:
    """What one container gets for `devices` of `resource` (KubeVirt's conventions).

    Host paths are always the host's `/dev/...`; the env var lists the IDs in
    request order, which KubeVirt relies on to map devices to the VM.
    """
    paths: list[str] = []
    for device in devices:
        for path in device.host_paths:
            if path not in paths:
                paths.append(path)
    specs = tuple(DeviceSpec(path, path, resource.permissions) for path in paths)
    prefix = _ENV_PREFIX.get(resource.kind)
    envs: tuple[tuple[str, str], ...] = ()
    if prefix is not None:
        envs = ((env_var_name(prefix, resource.name), ",".join(d.id for d in devices)),)
    return ContainerAllocation(envs=envs, devices=specs)


def preferred_devices(
    available: Sequence[AdvertisedDevice],
    must_include: Sequence[AdvertisedDevice],
    size: int,
) -> tuple[str, ...]:
    """Pick `size` devices, packing into as few NUMA nodes and IOMMU groups as we can.

    Must-include devices always come first. The rest are taken from the NUMA
    node that can hold the whole request (preferring nodes the must-include
    devices are on, then the fullest), and within it from groups already in
    use, then from the groups with the most free devices. Ties break on ID so
    the answer is deterministic.
    """
    chosen = list(dict.fromkeys(d.id for d in must_include))
    if len(chosen) >= size:
        return tuple(chosen)
    chosen_set = set(chosen)
    free = [d for d in available if d.id not in chosen_set]
    need = size - len(chosen)
    by_node: dict[int | None, list[AdvertisedDevice]] = {}
    for device in free:
        by_node.setdefault(device.numa_node, []).append(device)
    must_nodes = Counter(d.numa_node for d in must_include)
    node_order = sorted(
        by_node,
        key=lambda node: (
            -must_nodes.get(node, 0),
            len(by_node[node]) < need,
            -len(by_node[node]),
            -1 if node is None else node,
        ),
    )
    used_groups = {d.iommu_group for d in must_include if d.iommu_group is not None}
    for node in node_order:
        if need <= 0:
            break
        picks = _pack_groups(by_node[node], used_groups, need)
        chosen.extend(d.id for d in picks)
        used_groups.update(d.iommu_group for d in picks if d.iommu_group is not None)
        need -= len(picks)
    return tuple(chosen)


def _pack_groups(
    candidates: Sequence[AdvertisedDevice], used_groups: set[int], need: int
) -> list[AdvertisedDevice]:
    groups: dict[int | None, list[AdvertisedDevice]] = {}
    for device in sorted(candidates, key=lambda d: d.id):
        groups.setdefault(device.iommu_group, []).append(device)

    def rank(group: int | None) -> tuple[bool, bool, int, int]:
        members = groups[group]
        return (
            group not in used_groups,
            # A group that fits entirely is better than one we would split.
            len(members) > need,
            -len(members),
            -1 if group is None else group,
        )

    picks: list[AdvertisedDevice] = []
    for group in sorted(groups, key=rank):
        for device in groups[group]:
            if len(picks) == need:
                return picks
            picks.append(device)
    return picks


def as_advertised(
    resource: str, device: AdvertisedDevice, reserved: Mapping[int, Allocation]
) -> AdvertisedDevice:
    """`device` as `resource` advertises it while `reserved` groups are held."""
    holder = reserved.get(device.iommu_group) if device.iommu_group is not None else None
    if holder is None or not device.healthy:
        return device
    if holder.resource == resource and device.id in holder.device_ids:
        return device
    return attrs.evolve(
        device,
        healthy=False,
        reason=f"IOMMU group {device.iommu_group} is held by {holder.describe()}",
    )
