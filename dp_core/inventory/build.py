"""The one inventory: every resource each front end would offer, derived
from a host snapshot, a config and the binding plan.

This is the one place that decides which devices are selected, how they are
named, which front end offers them and when they are healthy (docs/design.md
§5). It is a pure function of its inputs, so `dp-server scan` and the running
server can never disagree. Each device class reads its own devices
(`classes.CLASSES`); a resource is one class, on one front end.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from ..binding.plan import BindDecision
from ..config.config import DEVICE_PLUGIN, Config, FrontendName
from ..host.pci import PciAddress, PciId
from ..host.snapshot import HostSnapshot
from .advertised import AdvertisedDevice, SkippedDevice
from .classes import CLASSES, DeviceKind
from .readers import Reading
from .resources import Inventory, Resource

__all__ = ["build_inventory", "shared_groups"]


def build_inventory(
    snapshot: HostSnapshot,
    config: Config,
    pci_names: Mapping[PciId, str] | None = None,
    bindings: Mapping[PciAddress, BindDecision] | None = None,
    giving_back: Collection[PciAddress] = (),
    moving_groups: Collection[int] = (),
) -> Inventory:
    """Every resource the server would offer on this host, sorted by name.

    `bindings` is the binding plan (`plan_bindings`): a function it moves to
    vfio-pci is advertised, Unhealthy until it gets there; one it refuses is
    skipped with the reason. A function in `giving_back` is on its way back
    to its host driver, and Unhealthy, so that nothing allocates it meanwhile;
    so is every member of an IOMMU group in `moving_groups` (a bind into it is
    under way, and may fail and hand the member back to a host driver).
    """
    reading = Reading(
        snapshot,
        config,
        pci_names or {},
        bindings or {},
        giving_back,
        moving_groups,
        {node: node for node in snapshot.dev_nodes},
        {group.number: group for group in snapshot.iommu_groups},
        config.vfio.interface,
    )
    collected: dict[tuple[str, FrontendName], tuple[DeviceKind, list[AdvertisedDevice], str]] = {}
    skipped: list[SkippedDevice] = []
    for device_class in CLASSES.values():
        kind = device_class.kind

        def add(
            name: str,
            frontend: FrontendName,
            device: AdvertisedDevice,
            permissions: str,
            kind: DeviceKind = kind,
        ) -> None:
            entry = collected.setdefault((name, frontend), (kind, [], permissions))
            if entry[0] is not kind:
                # Derived names can meet an explicit one; one resource never mixes kinds.
                if frontend == DEVICE_PLUGIN:
                    reason = f"resource {name} is already served for {entry[0].value} devices"
                    skipped.append(SkippedDevice(device.id, reason, name, device.driver))
                return
            entry[1].append(device)

        device_class.read(reading, add, skipped.append)
    resources = tuple(
        Resource(name, kind, tuple(devices), permissions, frontend=frontend)
        for (name, frontend), (kind, devices, permissions) in sorted(collected.items())
    )
    return Inventory(resources, tuple(skipped))


def shared_groups(
    resources: Iterable[Resource], also: Collection[int] = ()
) -> dict[int, list[tuple[str, int]]]:
    """IOMMU group -> (resource, index) of each advertised member, for groups of two or more.

    A device alone in its group is mostly held by its own allocations,
    which leave it as it is; most groups are such, and there are thousands.
    Groups in `also` are kept with one member: another front end offers a
    sibling, whose holder changes how this member is advertised. (A front
    end that holds a device it does not offer adds its group when it does.)
    """
    members: dict[int, list[tuple[str, int]]] = {}
    for resource in resources:
        for index, device in enumerate(resource.devices):
            if device.iommu_group is not None:
                members.setdefault(device.iommu_group, []).append((resource.name, index))
    return {group: found for group, found in members.items() if len(found) > 1 or group in also}
