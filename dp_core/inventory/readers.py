"""How each device class finds its devices on the host: which the config
selects, under which resource name and front end, and when each is healthy
(docs/design.md §5). One reader per class (`classes.CLASSES` names them);
`build.build_inventory` runs them in order.

A reader is given what it reads (`Reading`) and reports each selected device
with `add` (a device to advertise) or `skip` (seen and not advertised, and
why). A device of a `frontend: dra` entry is reported both ways: skipped by
the device-plugin API (so `dp-server scan` says where it went), and added to
the DRA front end's resource when it would be served.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping

import attrs

from ..binding.plan import BindDecision
from ..config.config import (
    DEVICE_PLUGIN,
    Config,
    FrontendName,
    MediatedDevice,
    PciHostDevice,
    SharedDevice,
    VfioInterface,
)
from ..config.names import MAX_DEVICE_ID_LENGTH, default_pci_resource_name, pci_ids_resource_name
from ..host.pci import PciAddress, PciDevice, PciId
from ..host.snapshot import VFIO_DRIVER, HostSnapshot, IommuGroup, MdevDevice
from .advertised import AdvertisedDevice, SkippedDevice
from .vfio import VFIO_PERMISSIONS, vfio_paths

__all__ = [
    "OFFERED_BY_DRA",
    "Add",
    "Reader",
    "Reading",
    "Skip",
    "mdev_resource_suffix",
    "read_mdevs",
    "read_pci",
    "read_shared",
]

# Why the device-plugin API is not given a device its entry gives to DRA.
OFFERED_BY_DRA = "frontend is dra: the DRA front end offers it"

#: add(resource name, front end, device, permissions)
Add = Callable[[str, FrontendName, AdvertisedDevice, str], None]
Skip = Callable[[SkippedDevice], None]


@attrs.frozen
class Reading:
    """What every reader reads: the host, the config, and the binding plan."""

    snapshot: HostSnapshot
    config: Config
    pci_names: Mapping[PciId, str]
    bindings: Mapping[PciAddress, BindDecision]
    giving_back: Collection[PciAddress]
    moving_groups: Collection[int]
    # Each node path as the snapshot holds it, so that the devices' host paths
    # share its strings instead of keeping a second copy per device.
    nodes: Mapping[str, str]
    groups: Mapping[int, IommuGroup]
    interface: VfioInterface


Reader = Callable[[Reading, Add, Skip], None]


def _address_key(pci: PciDevice) -> tuple[int, int, int, int]:
    # A plain tuple sorts far faster than attrs' generated ordering.
    address = pci.address
    return (address.domain, address.bus, address.slot, address.function)


def read_pci(reading: Reading, add: Add, skip: Skip) -> None:
    """PCI functions: by the config's `pciHostDevices`, or without selectors
    every function on vfio-pci; moves the binding plan makes or refuses."""
    snapshot, bindings = reading.snapshot, reading.bindings
    giving_back, moving_groups = reading.giving_back, reading.moving_groups
    entries = reading.config.pci_selectors()
    for pci in sorted(snapshot.pci_devices, key=_address_key):
        # Most hosts bind nothing: skip hashing 4,096 addresses for an empty plan.
        bind = bindings.get(pci.address) if bindings else None
        decision = _select_pci(pci, reading, entries, bind)
        if decision is None:
            continue
        name, frontend, skip_reason = decision
        if frontend != DEVICE_PLUGIN:
            skip(SkippedDevice(str(pci.address), OFFERED_BY_DRA, name, pci.driver))
        if skip_reason:
            if frontend == DEVICE_PLUGIN:
                skip(SkippedDevice(str(pci.address), skip_reason, name, pci.driver))
            continue
        device = _pci_device(pci, reading)
        if bind is not None:
            reason = f"{_held_by(pci)}; {_bind_outcome(bind)}"
            device = attrs.evolve(device, healthy=False, reason=reason)
        elif giving_back and pci.address in giving_back:
            reason = (
                "dp is giving it back to its host driver: its IOMMU group cannot be moved whole"
            )
            device = attrs.evolve(device, healthy=False, reason=reason)
        elif moving_groups and device.healthy and pci.iommu_group in moving_groups:
            reason = f"dp is moving a member of IOMMU group {pci.iommu_group} to vfio-pci"
            device = attrs.evolve(device, healthy=False, reason=reason)
        add(name, frontend, device, VFIO_PERMISSIONS)


def _derived_pci_name(pci: PciDevice, config: Config, pci_names: Mapping[PciId, str]) -> str:
    if config.naming.source == "pci-ids":
        return pci_ids_resource_name(pci.pci_id, pci_names, config.naming.domain)
    return default_pci_resource_name(pci.pci_id, config.naming.domain)


def _select_pci(
    pci: PciDevice,
    reading: Reading,
    entries: Mapping[tuple[int, int], PciHostDevice],
    bind: BindDecision | None,
) -> tuple[str, FrontendName, str] | None:
    """(resource name, front end, skip reason or "") for a selected device; None
    if unselected."""
    if pci.is_bridge:
        return None
    config = reading.config
    if config.permitted_host_devices is None:
        # Without selectors only what the operator already gave to VFIO is served.
        if pci.driver != VFIO_DRIVER:
            return None
        return _derived_pci_name(pci, config, reading.pci_names), DEVICE_PLUGIN, ""
    entry = entries.get((pci.vendor, pci.device))
    if entry is None:
        return None
    name = entry.resource_name or _derived_pci_name(pci, config, reading.pci_names)
    if entry.not_served_because:
        # Left to another plugin, whichever front end it names: the entry is not dp's.
        return name, DEVICE_PLUGIN, entry.not_served_because
    if pci.driver not in (VFIO_DRIVER, None):
        if bind is None:
            return name, entry.frontend, f"{_held_by(pci)}; no binding policy moves it to vfio-pci"
        if not bind.binds:
            return name, entry.frontend, f"{_held_by(pci)}; {_bind_outcome(bind)}"
    return name, entry.frontend, ""


def _held_by(pci: PciDevice) -> str:
    return f"bound to host driver {pci.driver}" if pci.driver else "not bound to any driver"


def _bind_outcome(bind: BindDecision) -> str:
    if bind.binds:
        return "the config's binding has dp move it to vfio-pci"
    return f"not moved to vfio-pci: {bind.refusal}"


def _pci_device(pci: PciDevice, reading: Reading) -> AdvertisedDevice:
    snapshot = reading.snapshot
    paths, healthy, reason = vfio_paths(pci, snapshot, reading.nodes, reading.interface)
    if pci.driver is None:
        healthy, reason = False, "not bound to any driver; bind it to vfio-pci"
    elif healthy:
        # iommufd, too, opens a device only when its whole group is VFIO's.
        group = None if pci.iommu_group is None else reading.groups.get(pci.iommu_group)
        if group is None:
            healthy, reason = False, f"IOMMU group {pci.iommu_group} is not listed in sysfs"
        else:
            viability = group.viability
            if not viability.viable:
                healthy = False
                reason = f"IOMMU group {group.number} is not viable: {viability.reason}"
    return AdvertisedDevice(
        id=str(pci.address),
        healthy=healthy,
        numa_node=pci.numa_node,
        iommu_group=pci.iommu_group,
        reason=reason,
        host_paths=paths,
        driver=pci.driver,
    )


def mdev_resource_suffix(type_name: str) -> str:
    """`GRID T4-1Q` -> `GRID_T4-1Q`: KubeVirt's mdev names keep dashes and dots."""
    return re.sub(r"[^A-Za-z0-9_.-]", "", re.sub(r"\s+", "_", type_name.strip()))


def read_mdevs(reading: Reading, add: Add, skip: Skip) -> None:
    """Mediated devices: by the config's `mediatedDevices` type names, or
    without selectors every mdev, named after its type."""
    snapshot = reading.snapshot
    for mdev in sorted(snapshot.mdevs, key=lambda m: m.uuid):
        decision = _select_mdev(mdev, snapshot, reading.config)
        if decision is None:
            continue
        name, frontend, skip_reason = decision
        if frontend != DEVICE_PLUGIN:
            skip(SkippedDevice(mdev.uuid, OFFERED_BY_DRA, name))
        if skip_reason:
            if frontend == DEVICE_PLUGIN:
                skip(SkippedDevice(mdev.uuid, skip_reason, name))
            continue
        add(name, frontend, _mdev_device(mdev, reading), VFIO_PERMISSIONS)


def _select_mdev(
    mdev: MdevDevice, snapshot: HostSnapshot, config: Config
) -> tuple[str, FrontendName, str] | None:
    type_name = snapshot.mdev_type_name(mdev)
    if type_name is None:
        return None
    if config.permitted_host_devices is None:
        return f"{config.naming.domain}/{mdev_resource_suffix(type_name)}", DEVICE_PLUGIN, ""
    entry = _matching_mdev_entry(type_name, config.permitted_host_devices.mediated_devices)
    if entry is None:
        return None
    name = entry.resource_name or f"{config.naming.domain}/{mdev_resource_suffix(type_name)}"
    if entry.not_served_because:
        return name, DEVICE_PLUGIN, entry.not_served_because
    return name, entry.frontend, ""


def _matching_mdev_entry(
    type_name: str, entries: Iterable[MediatedDevice]
) -> MediatedDevice | None:
    for entry in entries:
        if entry.mdev_name_selector.strip() == type_name.strip():
            return entry
    return None


def _mdev_device(mdev: MdevDevice, reading: Reading) -> AdvertisedDevice:
    snapshot = reading.snapshot
    # An mdev's group is its own (viable), and its VFIO nodes follow `interface`.
    paths, healthy, reason = vfio_paths(mdev, snapshot, reading.nodes, reading.interface)
    # A parent that is no PCI function (a virtual device) has no NUMA node.
    parent = None if mdev.parent_address is None else snapshot.device(mdev.parent_address)
    return AdvertisedDevice(
        id=mdev.uuid,
        healthy=healthy,
        numa_node=parent.numa_node if parent is not None else None,
        iommu_group=mdev.iommu_group,
        reason=reason,
        host_paths=paths,
    )


def read_shared(reading: Reading, add: Add, skip: Skip) -> None:
    """Shared character devices (`/dev/kvm`, ...): `count` interchangeable
    devices each, for the device-plugin API."""
    for shared in reading.config.enabled_shared_devices:
        for device in _shared_devices(shared, reading.snapshot):
            add(shared.resource_name, DEVICE_PLUGIN, device, shared.permissions)


def _shared_devices(shared: SharedDevice, snapshot: HostSnapshot) -> Iterable[AdvertisedDevice]:
    present = snapshot.has_dev_node(shared.path)
    reason = "" if present else f"{shared.path} does not exist"
    width = len(str(shared.count - 1))
    # Device IDs are capped at 63 characters by the kubelet's API.
    stem = shared.resource_name.rsplit("/", 1)[1][: MAX_DEVICE_ID_LENGTH - width - 1]
    for index in range(shared.count):
        yield AdvertisedDevice(
            id=f"{stem}-{index:0{width}d}",
            healthy=present,
            reason=reason,
            host_paths=(shared.path,),
        )
