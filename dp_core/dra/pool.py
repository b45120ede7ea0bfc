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

Everything above is decided group by group, from the group's devices and
its holder alone. `Pool` keeps the content as the holders change, working
out again only the groups whose holder changed: a Prepare or an Unprepare
costs one group, not the whole node's catalogue.

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
from .pool_content import CounterConsumption, CounterSet, DeviceTaint, PoolContent, PoolDevice

__all__ = [
    "COUNTER",
    "DraDevice",
    "PoolOptions",
    "dra_catalogue",
    "Pool",
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


GroupKey = tuple[int, str]


def _group_key(device: DraDevice) -> GroupKey:
    """Its IOMMU group's key; a device with no group is a group of its own."""
    group = device.iommu_group
    return (group, "") if group is not None else (-1, device.name)


def _by_group(devices: Iterable[DraDevice]) -> dict[GroupKey, tuple[DraDevice, ...]]:
    """The devices by IOMMU group, each group's sorted by name."""
    groups: dict[GroupKey, list[DraDevice]] = {}
    for device in sorted(devices, key=lambda device: device.name):
        groups.setdefault(_group_key(device), []).append(device)
    return {key: tuple(members) for key, members in groups.items()}


@attrs.frozen
class _GroupPart:
    """One IOMMU group's share of the pool: its devices and its counter set."""

    devices: tuple[PoolDevice, ...]
    counter_set: CounterSet | None


def _held_elsewhere(device: DraDevice, holder: Holder | None) -> bool:
    """Whether its group's holder is anything but a claim holding the device."""
    return holder is not None and not holds(holder, DRA, device.name)


def _representative(members: Sequence[DraDevice], holder: Holder | None) -> DraDevice:
    """The one member of a group published without shared counters: the one a
    claim holds, else the first healthy one, else the first (sorted by name)."""
    held = [d for d in members if holder is not None and holds(holder, DRA, d.name)]
    healthy = [d for d in members if d.advertised.healthy]
    return (held or healthy or list(members))[0]


def _taint_key(driver: str, what: str) -> str:
    return f"{driver}/{what}"


def _group_part(
    members: Sequence[DraDevice], holder: Holder | None, options: PoolOptions
) -> _GroupPart:
    """What one IOMMU group's devices (sorted by name), with the group's holder,
    put in the pool. Everything in the pool is decided group by group."""
    offered = list(members)
    if not options.partitionable:
        # Only a counter keeps a whole group's device apart from its members,
        # and only one member of a group apart from another.
        offered = [d for d in offered if not d.members]
        if len(offered) > 1:
            offered = [_representative(offered, holder)]
    # A group a claim holds through a member that consumes the group's
    # counter is held in the scheduler's eyes already: no mark for the rest.
    # Which members consume it depends on which are published, so settle it:
    # each round can only withdraw that cover, never grant it.
    covered = options.partitionable and holder is not None and holder.owner == DRA
    held_ids = holder.device_ids if holder is not None else ()
    while True:
        published = _published(offered, holder, options, covered)
        shared = options.partitionable and len(published) > 1
        names = {device.name for device, _ in published}
        still = covered and shared and any(n in names for n in held_ids)
        if still == covered:
            break
        covered = still
    group = members[0].iommu_group
    if not shared or group is None:
        return _GroupPart(
            tuple(PoolDevice(d.name, d.attributes, (), m) for d, m in published), None
        )
    consumes = (CounterConsumption(group_counter_set(group), ((COUNTER, 1),)),)
    return _GroupPart(
        tuple(PoolDevice(d.name, d.attributes, consumes, m) for d, m in published),
        CounterSet(group_counter_set(group), ((COUNTER, 1),)),
    )


def _published(
    offered: Sequence[DraDevice], holder: Holder | None, options: PoolOptions, covered: bool
) -> list[tuple[DraDevice, tuple[DeviceTaint, ...]]]:
    """One group's devices offered, each with its taints; `covered`: the
    scheduler sees the group's holder through the counter (no marks for it)."""
    published: list[tuple[DraDevice, tuple[DeviceTaint, ...]]] = []
    for device in offered:
        taints: list[DeviceTaint] = []
        if not device.advertised.healthy:
            taints.append(DeviceTaint(_taint_key(options.driver, "unhealthy")))
        if not covered and _held_elsewhere(device, holder):
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


def _assemble(parts: Iterable[_GroupPart], options: PoolOptions) -> PoolContent:
    devices: list[PoolDevice] = []
    counter_sets: list[CounterSet] = []
    for part in parts:
        devices += part.devices
        if part.counter_set is not None:
            counter_sets.append(part.counter_set)
    return PoolContent(
        options.driver,
        options.node_name,
        options.node_name,
        tuple(sorted(devices, key=lambda device: device.name)),
        tuple(sorted(counter_sets, key=lambda counter_set: counter_set.name)),
    )


def _holder(key: GroupKey, reserved: Mapping[int, Holder]) -> Holder | None:
    return reserved.get(key[0]) if not key[1] else None


def pool_content(
    devices: Iterable[DraDevice], reserved: Mapping[int, Holder], options: PoolOptions
) -> PoolContent:
    """The node's pool: what the scheduler may allocate now (module docstring)."""
    return _assemble(
        (
            _group_part(members, _holder(key, reserved), options)
            for key, members in _by_group(devices).items()
        ),
        options,
    )


class Pool:
    """`pool_content` of one catalogue and options as the holders change,
    worked out again only for the groups whose holder changed.

    Holders are frozen values, so a group whose holder is the same object
    as last time has the same share of the pool."""

    def __init__(self, devices: Iterable[DraDevice], options: PoolOptions) -> None:
        self.options = options
        self._groups = _by_group(devices)
        self._parts: dict[GroupKey, tuple[Holder | None, _GroupPart]] = {}
        self._content: PoolContent | None = None

    def content(self, reserved: Mapping[int, Holder]) -> PoolContent:
        """`pool_content(devices, reserved, options)`."""
        content = self._content
        changed = content is None
        parts = self._parts
        for key, members in self._groups.items():
            holder = _holder(key, reserved)
            known = parts.get(key)
            if known is None or known[0] is not holder:
                part = _group_part(members, holder, self.options)
                changed = changed or known is None or known[1] != part
                parts[key] = (holder, part)
        if changed or content is None:
            content = self._content = _assemble((p for _, p in parts.values()), self.options)
        return content
