"""What each resource advertises, derived from a host snapshot and a config.

This is the one place that decides which devices are selected, how they are
named and when they are healthy (docs/design.md §5). It is a pure function of its
inputs, so `dp-server scan` and the running server can never disagree.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Collection, Iterable, Mapping

import attrs

from .advertised import AdvertisedDevice
from .bind_plan import BindDecision
from .config import (
    Config,
    MediatedDevice,
    PciHostDevice,
    SharedDevice,
    VfioInterface,
)
from .host import IOMMUFD_NODE, VFIO_DRIVER, HostSnapshot, IommuGroup, MdevDevice
from .names import MAX_DEVICE_ID_LENGTH, default_pci_resource_name, pci_ids_resource_name
from .pci import PciAddress, PciDevice, PciId

__all__ = [
    "VFIO_CONTAINER",
    "CdevState",
    "DeviceKind",
    "Inventory",
    "Resource",
    "SkippedDevice",
    "build_inventory",
    "cdev_state",
    "shared_groups",
]

VFIO_CONTAINER = "/dev/vfio/vfio"
# Why the device-plugin front end skips a device its entry gives to DRA.
DRA_FRONTEND = "frontend is dra: the DRA front end offers it"
# KubeVirt hands out VFIO nodes with mknod rights too.
VFIO_PERMISSIONS = "mrw"


class DeviceKind(enum.Enum):
    PCI = "pci"
    MDEV = "mdev"
    SHARED = "shared"


@attrs.frozen
class Resource:
    name: str
    kind: DeviceKind
    devices: tuple[AdvertisedDevice, ...]
    permissions: str = "rw"

    def device(self, device_id: str) -> AdvertisedDevice | None:
        for device in self.devices:
            if device.id == device_id:
                return device
        return None

    @property
    def healthy_count(self) -> int:
        return sum(1 for device in self.devices if device.healthy)


@attrs.frozen
class SkippedDevice:
    """A device that was seen and deliberately not advertised, and why."""

    id: str
    reason: str
    resource_name: str | None = None
    driver: str | None = None


@attrs.frozen
class Inventory:
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


def build_inventory(
    snapshot: HostSnapshot,
    config: Config,
    pci_names: Mapping[PciId, str] | None = None,
    bindings: Mapping[PciAddress, BindDecision] | None = None,
    giving_back: Collection[PciAddress] = (),
    moving_groups: Collection[int] = (),
) -> Inventory:
    """Every resource the server would advertise on this host, sorted by name.

    `bindings` is the binding plan (`plan_bindings`): a function it moves to
    vfio-pci is advertised, Unhealthy until it gets there; one it refuses is
    skipped with the reason. A function in `giving_back` is on its way back
    to its host driver, and Unhealthy, so that nothing allocates it meanwhile;
    so is every member of an IOMMU group in `moving_groups` (a bind into it is
    under way, and may fail and hand the member back to a host driver).
    """
    bindings = bindings or {}
    collected: dict[str, tuple[DeviceKind, list[AdvertisedDevice], str]] = {}
    skipped: list[SkippedDevice] = []

    def add(name: str, kind: DeviceKind, device: AdvertisedDevice, permissions: str) -> None:
        entry = collected.setdefault(name, (kind, [], permissions))
        if entry[0] is not kind:
            # Derived names can meet an explicit one; one resource never mixes kinds.
            reason = f"resource {name} is already served for {entry[0].value} devices"
            skipped.append(SkippedDevice(device.id, reason, name, device.driver))
            return
        entry[1].append(device)

    # Each node path as the snapshot holds it, so that the devices' host paths
    # share its strings instead of keeping a second copy per device.
    nodes = {node: node for node in snapshot.dev_nodes}
    groups = {group.number: group for group in snapshot.iommu_groups}
    entries = config.pci_selectors()
    interface = config.vfio.interface
    for pci in sorted(snapshot.pci_devices, key=_address_key):
        # Most hosts bind nothing: skip hashing 4,096 addresses for an empty plan.
        bind = bindings.get(pci.address) if bindings else None
        decision = _select_pci(pci, config, pci_names or {}, entries, bind)
        if decision is None:
            continue
        name, skip_reason = decision
        if skip_reason:
            skipped.append(SkippedDevice(str(pci.address), skip_reason, name, pci.driver))
            continue
        device = _pci_device(pci, snapshot, nodes, groups, interface)
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
        add(name, DeviceKind.PCI, device, VFIO_PERMISSIONS)

    for mdev in sorted(snapshot.mdevs, key=lambda m: m.uuid):
        mdev_decision = _select_mdev(mdev, snapshot, config)
        if mdev_decision is None:
            continue
        name, skip_reason = mdev_decision
        if skip_reason:
            skipped.append(SkippedDevice(mdev.uuid, skip_reason, name))
            continue
        device = _mdev_device(mdev, snapshot, nodes, interface)
        add(name, DeviceKind.MDEV, device, VFIO_PERMISSIONS)

    for shared in config.enabled_shared_devices:
        for device in _shared_devices(shared, snapshot):
            add(shared.resource_name, DeviceKind.SHARED, device, shared.permissions)

    resources = tuple(
        Resource(name, kind, tuple(devices), permissions)
        for name, (kind, devices, permissions) in sorted(collected.items())
    )
    return Inventory(resources, tuple(skipped))


def shared_groups(
    resources: Iterable[Resource], also: Collection[int] = ()
) -> dict[int, list[tuple[str, int]]]:
    """IOMMU group -> (resource, index) of each advertised member, for groups of two or more.

    A device alone in its group is only ever held by its own allocations,
    which leave it as it is; most groups are such, and there are thousands.
    Groups in `also` are kept with one member: another front end offers a
    sibling, whose holder changes how this member is advertised.
    """
    members: dict[int, list[tuple[str, int]]] = {}
    for resource in resources:
        for index, device in enumerate(resource.devices):
            if device.iommu_group is not None:
                members.setdefault(device.iommu_group, []).append((resource.name, index))
    return {group: found for group, found in members.items() if len(found) > 1 or group in also}


def _address_key(pci: PciDevice) -> tuple[int, int, int, int]:
    # A plain tuple sorts far faster than attrs' generated ordering.
    address = pci.address
    return (address.domain, address.bus, address.slot, address.function)


def _derived_pci_name(pci: PciDevice, config: Config, pci_names: Mapping[PciId, str]) -> str:
    if config.naming.source == "pci-ids":
        return pci_ids_resource_name(pci.pci_id, pci_names, config.naming.domain)
    return default_pci_resource_name(pci.pci_id, config.naming.domain)


def _select_pci(
    pci: PciDevice,
    config: Config,
    pci_names: Mapping[PciId, str],
    entries: Mapping[tuple[int, int], PciHostDevice],
    bind: BindDecision | None,
) -> tuple[str, str] | None:
    """(resource name, skip reason or "") for a selected device; None if unselected."""
    if pci.is_bridge:
        return None
    if config.permitted_host_devices is None:
        # Without selectors only what the operator already gave to VFIO is served.
        if pci.driver != VFIO_DRIVER:
            return None
        return _derived_pci_name(pci, config, pci_names), ""
    entry = entries.get((pci.vendor, pci.device))
    if entry is None:
        return None
    name = entry.resource_name or _derived_pci_name(pci, config, pci_names)
    if entry.not_served_because:
        return name, entry.not_served_because
    if entry.frontend == "dra":
        return name, DRA_FRONTEND
    if pci.driver not in (VFIO_DRIVER, None):
        if bind is None:
            return name, f"{_held_by(pci)}; no binding policy moves it to vfio-pci"
        if not bind.binds:
            return name, f"{_held_by(pci)}; {_bind_outcome(bind)}"
    return name, ""


def _held_by(pci: PciDevice) -> str:
    return f"bound to host driver {pci.driver}" if pci.driver else "not bound to any driver"


def _bind_outcome(bind: BindDecision) -> str:
    if bind.binds:
        return "the config's binding has dp move it to vfio-pci"
    return f"not moved to vfio-pci: {bind.refusal}"


def _group_paths(group_number: int | None, nodes: Mapping[str, str]) -> tuple[str, ...]:
    """The device nodes a container needs for a member of the group."""
    if group_number is None:
        return ()
    node = f"/dev/vfio/{group_number}"
    return (VFIO_CONTAINER, nodes.get(node, node))


def _group_health(paths: tuple[str, ...], snapshot: HostSnapshot) -> tuple[bool, str]:
    """Health as far as the group's device nodes tell, given `_group_paths`."""
    if not paths:
        return False, "no IOMMU group (is the IOMMU enabled?)"
    group_node = paths[1]
    if not snapshot.has_dev_node(VFIO_CONTAINER):
        return False, f"{VFIO_CONTAINER} does not exist (is the vfio module loaded?)"
    if not snapshot.has_dev_node(group_node):
        return False, f"{group_node} does not exist"
    return True, ""


@attrs.frozen
class CdevState:
    """A device's VFIO character device: the node to hand out, or why there is none."""

    path: str | None
    reason: str = ""


def cdev_state(device: PciDevice | MdevDevice, snapshot: HostSnapshot) -> CdevState:
    """Whether `/dev/vfio/devices/vfioN` of a function or an mdev can be handed
    out, and if not, why.

    Only a node that exists is ever handed out: a runtime refuses to create a
    container given a node that is missing (kubevirt #18895). An mdev is a VFIO
    device of its own, with its own `vfio-dev/` entry (Linux 6.12 gives the
    sample drivers' mdevs one, which binds to iommufd like a function's).
    """
    entry = device.vfio_dev
    if entry is None:
        if isinstance(device, MdevDevice):
            return CdevState(None, "no vfio-dev entry in sysfs (Linux before 6.1)")
        return CdevState(None, "no vfio-dev entry in sysfs (not on vfio-pci, or Linux before 6.1)")
    if entry.problem:
        return CdevState(None, f"vfio-dev cannot be read: {entry.problem}")
    path = entry.host_path
    if path is None:
        return CdevState(
            None,
            f"vfio-dev/{entry.name} has no dev file: the kernel has no VFIO character "
            "devices (CONFIG_VFIO_DEVICE_CDEV)",
        )
    if not snapshot.has_dev_node(path):
        return CdevState(None, f"{path} does not exist")
    return CdevState(path, "")


def _vfio_paths(
    device: PciDevice | MdevDevice,
    snapshot: HostSnapshot,
    nodes: Mapping[str, str],
    interface: VfioInterface,
) -> tuple[tuple[str, ...], bool, str]:
    """(host paths, healthy, reason) as far as the device nodes of `interface` tell."""
    paths = _group_paths(device.iommu_group, nodes)
    if interface == "group":
        return (paths, *_group_health(paths, snapshot))
    cdev = cdev_state(device, snapshot)
    cdev_node = None if cdev.path is None else nodes.get(cdev.path, cdev.path)
    if interface == "group+cdev":
        healthy, reason = _group_health(paths, snapshot)
        return ((*paths, cdev_node) if cdev_node else paths), healthy, reason
    iommufd = (nodes.get(IOMMUFD_NODE, IOMMUFD_NODE),)
    paths = (*iommufd, cdev_node) if cdev_node else iommufd
    if device.iommu_group is None:
        return paths, False, "no IOMMU group (is the IOMMU enabled?)"
    if not snapshot.has_iommufd:
        return paths, False, f"{IOMMUFD_NODE} does not exist (is the kernel built with iommufd?)"
    if cdev_node is None:
        return paths, False, f"no VFIO character device: {cdev.reason}"
    return paths, True, ""


def _pci_device(
    pci: PciDevice,
    snapshot: HostSnapshot,
    nodes: Mapping[str, str],
    groups: Mapping[int, IommuGroup],
    interface: VfioInterface,
) -> AdvertisedDevice:
    paths, healthy, reason = _vfio_paths(pci, snapshot, nodes, interface)
    if pci.driver is None:
        healthy, reason = False, "not bound to any driver; bind it to vfio-pci"
    elif healthy:
        # iommufd, too, opens a device only when its whole group is VFIO's.
        group = None if pci.iommu_group is None else groups.get(pci.iommu_group)
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


def _select_mdev(
    mdev: MdevDevice, snapshot: HostSnapshot, config: Config
) -> tuple[str, str] | None:
    type_name = snapshot.mdev_type_name(mdev)
    if type_name is None:
        return None
    if config.permitted_host_devices is None:
        return f"{config.naming.domain}/{mdev_resource_suffix(type_name)}", ""
    entry = _matching_mdev_entry(type_name, config.permitted_host_devices.mediated_devices)
    if entry is None:
        return None
    name = entry.resource_name or f"{config.naming.domain}/{mdev_resource_suffix(type_name)}"
    if entry.not_served_because:
        return name, entry.not_served_because
    if entry.frontend == "dra":
        return name, DRA_FRONTEND
    return name, ""


def _matching_mdev_entry(
    type_name: str, entries: Iterable[MediatedDevice]
) -> MediatedDevice | None:
    for entry in entries:
        if entry.mdev_name_selector.strip() == type_name.strip():
            return entry
    return None


def _mdev_device(
    mdev: MdevDevice, snapshot: HostSnapshot, nodes: Mapping[str, str], interface: VfioInterface
) -> AdvertisedDevice:
    # An mdev's group is its own (viable), and its VFIO nodes follow `interface`.
    paths, healthy, reason = _vfio_paths(mdev, snapshot, nodes, interface)
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
