"""Which devices the DRA front end offers, and the content of the node's pool.

The DRA front end offers the devices whose config entry says `frontend: dra`;
`build_inventory` judges their health exactly as it does the device-plugin
front end's, and `dra_catalogue` names them (`names`), each device class as
`_OFFERS` says. `pool_content` is then a pure function of that catalogue, the
IOMMU groups the one ledger (`Ledger`) holds, and the cluster's features:

- a device that is unhealthy, or whose group another holder has, is left
  out, or with `device_taints` published with a `NoSchedule` taint;
- with `partitionable` (KEP-4815), every group with two or more published
  members gets a counter set `iommu-group-<n>` with one counter `slot` of 1,
  which each member consumes whole, so the scheduler never puts two of them
  in two claims; without it only one member of such a group is published
  (the one a claim holds, else the first healthy one by name), since nothing
  else could keep the scheduler from splitting the group.

A group with two or more PCI functions offered here also gets a device that
stands for the whole group (`iommu-group-<n>`, `resourceName` `iommu-group`):
it consumes the group's counter like each member, so one claim can take every
member at once while two claims still never split the group. It is offered
only with `partitionable` (nothing else keeps it apart from its members) and
while two or more of its members are; it is unhealthy while any member is.
Preparing it hands the container every member's device nodes, and its
KEP-5304 metadata names the lead function (lowest address) as the PCI
address, which is the one function KubeVirt 1.9 passes to a VM per request.

Only what changes the scheduler's view is marked: a group a DRA claim holds
through a member that consumes the group's counter needs no mark on its
other members, since the scheduler counts that member's allocation against
the counter already; so preparing or unpreparing such a claim leaves the
pool as it is. A group held through the device-plugin front end (or by a
claim whose device is not in the pool) is invisible to the scheduler: its
members are marked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs

from ..config.config import DRA
from ..host.pci import PciAddress
from ..host.snapshot import HostSnapshot, MdevDevice
from ..inventory.advertised import AdvertisedDevice
from ..inventory.classes import DeviceKind
from ..inventory.resources import Inventory
from ..ledger import Holder, holds
from .names import (
    Attributes,
    dns_label_error,
    group_attributes,
    group_device_name,
    mdev_attributes,
    mdev_device_name,
    pci_attributes,
    pci_device_name,
)
from .slices import CounterConsumption, CounterSet, DeviceTaint, PoolContent, PoolDevice

__all__ = [
    "COUNTER",
    "DraDevice",
    "PoolOptions",
    "dra_catalogue",
    "group_counter_set",
    "pool_content",
]

COUNTER = "slot"


@attrs.frozen
class PoolOptions:
    """The pool's driver and node, and which DRA features the cluster has.

    `partitionable`: shared counters (KEP-4815; beta, on by default, from
    1.36). `device_taints`: device taints (KEP-5055; the same).
    """

    driver: str
    node_name: str
    partitionable: bool = True
    device_taints: bool = False

    def __attrs_post_init__(self) -> None:
        # The pool is named after the node, and a node name is a DNS subdomain.
        if not self.node_name or len(self.node_name) > 253:
            raise ValueError(f"{self.node_name!r} is not a node name")


@attrs.frozen
class DraDevice:
    """One device the DRA front end offers: its pool name, the device-plugin
    resource it would belong to, and what `build_inventory` says of it.

    A device standing for a whole IOMMU group has its `members` (each a
    device of its own); its `resource` and `advertised.id` are its lead's."""

    name: str
    resource: str
    kind: DeviceKind
    advertised: AdvertisedDevice
    attributes: Attributes = ()
    members: tuple[DraDevice, ...] = ()

    @property
    def iommu_group(self) -> int | None:
        return self.advertised.iommu_group

    @property
    def parts(self) -> tuple[DraDevice, ...]:
        """What a claim given this device gets: its members, or itself."""
        return self.members or (self,)


def _pci_offer(
    advertised: AdvertisedDevice, resource: str, snapshot: HostSnapshot
) -> tuple[str, Attributes, tuple[str, ...]] | None:
    pci = snapshot.device(PciAddress.parse(advertised.id))
    if pci is None:
        return None
    attributes, issues = pci_attributes(pci, resource)
    return pci_device_name(pci.address), attributes, issues


def _mdev_offer(
    advertised: AdvertisedDevice, resource: str, snapshot: HostSnapshot
) -> tuple[str, Attributes, tuple[str, ...]] | None:
    mdev: MdevDevice | None = snapshot.mdev(advertised.id)
    if mdev is None:
        return None
    name = mdev_device_name(advertised.id)
    if name is None:
        error = dns_label_error(f"mdev-{advertised.id.lower()}")
        raise _NotOffered(f"mdev {advertised.id}: not offered: {error}")
    attributes, issues = mdev_attributes(mdev, snapshot, resource)
    return name, attributes, issues


class _NotOffered(Exception):
    """A device the pool cannot offer; the message says which and why."""


#: How each device class is offered in the pool: its device's name and
#: attributes (None: it is not on the host). A class not here is not offered.
_OFFERS = {DeviceKind.PCI: _pci_offer, DeviceKind.MDEV: _mdev_offer}
#: Classes whose IOMMU groups of two or more members get a device of their own.
_WHOLE_GROUPS = frozenset({DeviceKind.PCI})


def dra_catalogue(
    inventory: Inventory, snapshot: HostSnapshot
) -> tuple[tuple[DraDevice, ...], tuple[str, ...]]:
    """The DRA front end's devices from its resources in `inventory`, sorted by
    name, and what could not be offered or described, and why."""
    devices: list[DraDevice] = []
    problems: list[str] = []
    for resource in inventory.resources:
        if resource.frontend != DRA:
            continue
        offer = _OFFERS.get(resource.kind)
        if offer is None:
            continue
        for advertised in resource.devices:
            try:
                offered = offer(advertised, resource.name, snapshot)
            except _NotOffered as problem:
                problems.append(str(problem))
                continue
            if offered is None:
                continue
            name, attributes, issues = offered
            problems += (f"device {name}: {issue}" for issue in issues)
            devices.append(DraDevice(name, resource.name, resource.kind, advertised, attributes))
    devices += _whole_groups(devices, snapshot, problems)
    devices.sort(key=lambda device: device.name)
    return tuple(devices), tuple(problems)


def _whole_groups(
    devices: Sequence[DraDevice], snapshot: HostSnapshot, problems: list[str]
) -> list[DraDevice]:
    """A device for each IOMMU group with two or more PCI functions offered here."""
    by_group: dict[int, list[DraDevice]] = {}
    for device in devices:
        if device.kind in _WHOLE_GROUPS and device.iommu_group is not None:
            by_group.setdefault(device.iommu_group, []).append(device)
    wholes = []
    for group, members in sorted(by_group.items()):
        if len(members) < 2:
            continue
        members.sort(key=lambda d: PciAddress.parse(d.advertised.id))
        lead = members[0]
        lead_pci = snapshot.device(PciAddress.parse(lead.advertised.id))
        assert lead_pci is not None  # the catalogue has only functions it found
        addresses = tuple(PciAddress.parse(m.advertised.id) for m in members)
        attributes, issues = group_attributes(lead_pci, lead.resource, addresses)
        name = group_device_name(group)
        problems.extend(f"device {name}: {issue}" for issue in issues)
        sick = [m for m in members if not m.advertised.healthy]
        paths = tuple(dict.fromkeys(p for m in members for p in m.advertised.host_paths))
        advertised = AdvertisedDevice(
            lead.advertised.id,
            not sick,
            lead.advertised.numa_node,
            group,
            f"{sick[0].name}: {sick[0].advertised.reason}" if sick else "",
            paths,
        )
        wholes.append(
            DraDevice(name, lead.resource, lead.kind, advertised, attributes, tuple(members))
        )
    return wholes


def group_counter_set(group: int) -> str:
    return f"iommu-group-{group}"


def _held_elsewhere(device: DraDevice, reserved: Mapping[int, Holder]) -> Holder | None:
    """The holder of the device's group, unless that holder is a claim holding the device."""
    group = device.iommu_group
    holder = reserved.get(group) if group is not None else None
    if holder is None or holds(holder, DRA, device.name):
        return None
    return holder


def _held_here(device: DraDevice, reserved: Mapping[int, Holder]) -> bool:
    group = device.iommu_group
    holder = reserved.get(group) if group is not None else None
    return holder is not None and holds(holder, DRA, device.name)


def _representatives(devices: Sequence[DraDevice], reserved: Mapping[int, Holder]) -> set[str]:
    """One member per group of two or more: the one a claim holds, else the
    first healthy one, else the first (all sorted by name)."""
    by_group: dict[int, list[DraDevice]] = {}
    for device in devices:
        if device.iommu_group is not None:
            by_group.setdefault(device.iommu_group, []).append(device)
    chosen = set()
    for members in by_group.values():
        if len(members) < 2:
            continue
        held = [d for d in members if _held_here(d, reserved)]
        healthy = [d for d in members if d.advertised.healthy]
        chosen.add((held or healthy or members)[0].name)
    return chosen


def _taint_key(driver: str, what: str) -> str:
    return f"{driver}/{what}"


def pool_content(
    devices: Iterable[DraDevice], reserved: Mapping[int, Holder], options: PoolOptions
) -> PoolContent:
    """The node's pool: what the scheduler may allocate now (module docstring)."""
    catalogue = sorted(devices, key=lambda device: device.name)
    keep: set[str] | None = None
    if not options.partitionable:
        # Only a counter keeps a whole group's device apart from its members.
        catalogue = [d for d in catalogue if not d.members]
        keep = _representatives(catalogue, reserved)
        grouped = {
            d.name
            for d in catalogue
            if d.iommu_group is not None
            and sum(1 for o in catalogue if o.iommu_group == d.iommu_group) > 1
        }
        catalogue = [d for d in catalogue if d.name not in grouped or d.name in keep]
    # A group a claim holds through a member that consumes the group's
    # counter is held in the scheduler's eyes already: no mark for the rest.
    # Which members consume it depends on which are published, so settle it:
    # each round can only withdraw that cover, never grant it.
    covered = {g for g, h in reserved.items() if h.owner == DRA} if options.partitionable else set()
    while True:
        published = _published(catalogue, reserved, options, covered)
        shared = _shared_groups(published) if options.partitionable else set()
        names = {device.name for device, _ in published}
        still = {
            g for g in covered if g in shared and any(n in names for n in reserved[g].device_ids)
        }
        if still == covered:
            break
        covered = still
    counter_sets = tuple(CounterSet(group_counter_set(g), ((COUNTER, 1),)) for g in sorted(shared))
    pool_devices = []
    for device, marks in published:
        consumes: tuple[CounterConsumption, ...] = ()
        group = device.iommu_group
        if group is not None and group in shared:
            consumes = (CounterConsumption(group_counter_set(group), ((COUNTER, 1),)),)
        pool_devices.append(PoolDevice(device.name, device.attributes, consumes, marks))
    return PoolContent(
        options.driver,
        options.node_name,
        options.node_name,
        tuple(pool_devices),
        tuple(sorted(counter_sets, key=lambda s: s.name)),
    )


def _published(
    catalogue: Sequence[DraDevice],
    reserved: Mapping[int, Holder],
    options: PoolOptions,
    covered: set[int],
) -> list[tuple[DraDevice, tuple[DeviceTaint, ...]]]:
    """The devices offered, each with its taints; `covered`: groups whose holder
    the scheduler sees through the counter (their members get no mark)."""
    published: list[tuple[DraDevice, tuple[DeviceTaint, ...]]] = []
    for device in catalogue:
        taints: list[DeviceTaint] = []
        if not device.advertised.healthy:
            taints.append(DeviceTaint(_taint_key(options.driver, "unhealthy")))
        held = _held_elsewhere(device, reserved)
        if device.iommu_group not in covered and held is not None:
            taints.append(DeviceTaint(_taint_key(options.driver, "iommu-group-held")))
        if taints and not options.device_taints:
            continue
        published.append((device, tuple(taints)))
    names = {device.name for device, _ in published}
    # A whole group's device while two or more of its members are offered.
    return [
        (device, marks)
        for device, marks in published
        if not device.members or sum(m.name in names for m in device.members) > 1
    ]


def _shared_groups(published: Sequence[tuple[DraDevice, object]]) -> set[int]:
    """Groups with two or more published devices: each gets a counter set."""
    members: dict[int, int] = {}
    for device, _ in published:
        if device.iommu_group is not None:
            members[device.iommu_group] = members.get(device.iommu_group, 0) + 1
    return {g for g, count in members.items() if count > 1}
