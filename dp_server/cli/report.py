"""What `dp-server scan` prints: the inventory as JSON (via cattrs) or a table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import cattrs

from dp_core import (
    IOMMUFD_NODE,
    VFIO_DRIVER,
    AdvertisedDevice,
    BindDecision,
    CdevState,
    DeviceKind,
    HostSnapshot,
    Inventory,
    MdevDevice,
    PciAddress,
    ScanProblem,
    cdev_state,
)

__all__ = ["inventory_document", "inventory_table", "report_converter"]

report_converter = cattrs.Converter()
report_converter.register_unstructure_hook(DeviceKind, lambda kind: kind.value)


def _device(device: AdvertisedDevice) -> dict[str, Any]:
    document: dict[str, Any] = {
        "id": device.id,
        "health": device.health,
        "numa_node": device.numa_node,
        "iommu_group": device.iommu_group,
    }
    if device.driver is not None:
        document["driver"] = device.driver
    if device.reason:
        document["reason"] = device.reason
    document["host_paths"] = list(device.host_paths)
    return document


report_converter.register_unstructure_hook(AdvertisedDevice, _device)


def _binding(decision: BindDecision) -> dict[str, Any]:
    document: dict[str, Any] = {
        "id": str(decision.address),
        "driver": decision.driver,
        "action": "bind" if decision.binds else "refused",
    }
    if decision.refusal:
        document["reason"] = decision.refusal
    return document


report_converter.register_unstructure_hook(BindDecision, _binding)

Plan = Mapping[PciAddress, BindDecision]


Mdevs = Mapping[str, MdevDevice]


def _cdev(
    device: AdvertisedDevice, kind: DeviceKind, snapshot: HostSnapshot, mdevs: Mdevs
) -> CdevState | None:
    """The VFIO character device of an advertised function or mdev (None if neither)."""
    if kind is DeviceKind.MDEV:
        mdev = mdevs.get(device.id)
        return None if mdev is None else cdev_state(mdev, snapshot)
    if kind is not DeviceKind.PCI:
        return None
    try:
        pci = snapshot.device(PciAddress.parse(device.id))
    except ValueError:
        return None
    return None if pci is None else cdev_state(pci, snapshot)


def _devices(
    kind: DeviceKind, devices: Any, snapshot: HostSnapshot, mdevs: Mdevs
) -> list[dict[str, Any]]:
    documents: list[dict[str, Any]] = report_converter.unstructure(list(devices))
    if kind is DeviceKind.SHARED:
        return documents
    for device, document in zip(devices, documents, strict=True):
        mdev = mdevs.get(device.id) if kind is DeviceKind.MDEV else None
        if mdev is not None:
            # The type and the parent by the kernel's names (a parent may be no PCI function).
            document["mdev_type"] = mdev.type_id
            document["parent"] = mdev.parent
        cdev = _cdev(device, kind, snapshot, mdevs)
        if cdev is not None:
            document["cdev"] = cdev.path
            if cdev.reason:
                document["cdev_reason"] = cdev.reason
    return documents


def _iommufd_line(snapshot: HostSnapshot) -> str:
    if snapshot.has_iommufd:
        return f"{IOMMUFD_NODE}: present (the kernel has iommufd)"
    return f"{IOMMUFD_NODE}: absent (no iommufd: the interface `iommufd` cannot serve here)"


def inventory_document(
    inventory: Inventory, snapshot: HostSnapshot, plan: Plan | None = None
) -> dict[str, Any]:
    """`{"resources": [{"name", "kind", "capacity", "allocatable", "devices"}], ...}`.

    A PCI device or an mdev says which VFIO character device it has (`cdev`,
    a path or null) and, without one, why (`cdev_reason`); an mdev, also its
    type (`mdev_type`) and its parent device (`parent`); `iommufd` says
    whether `/dev/iommu` exists.

    With a binding plan, `"binding"` lists what `serve` would move to vfio-pci
    and what it refuses to, with the reason.
    """
    mdevs = {mdev.uuid: mdev for mdev in snapshot.mdevs}
    resources = [
        {
            "name": resource.name,
            "kind": resource.kind.value,
            "capacity": len(resource.devices),
            "allocatable": resource.healthy_count,
            "devices": _devices(resource.kind, resource.devices, snapshot, mdevs),
        }
        for resource in inventory.resources
    ]
    document = {
        "resources": resources,
        "iommufd": {"path": IOMMUFD_NODE, "present": snapshot.has_iommufd},
        "skipped": report_converter.unstructure(list(inventory.skipped)),
        "problems": report_converter.unstructure(list(snapshot.problems), list[ScanProblem]),
    }
    if plan:
        document["binding"] = [report_converter.unstructure(d, BindDecision) for d in plan.values()]
    return document


def inventory_table(inventory: Inventory, snapshot: HostSnapshot, plan: Plan | None = None) -> str:
    lines: list[str] = []
    mdevs = {mdev.uuid: mdev for mdev in snapshot.mdevs}
    for resource in inventory.resources:
        lines.append(
            f"{resource.name}  ({resource.kind.value}, {resource.healthy_count}/"
            f"{len(resource.devices)} healthy)"
        )
        shown = resource.devices
        if resource.kind is DeviceKind.SHARED and len(shown) > 3:
            first = shown[0]
            state = first.health + (f": {first.reason}" if first.reason else "")
            lines.append(f"  {first.id} .. {shown[-1].id}  {len(shown)} devices  {state}")
            continue
        width = max(len(d.id) for d in shown) if shown else 0
        for device in shown:
            numa = "-" if device.numa_node is None else str(device.numa_node)
            group = "-" if device.iommu_group is None else str(device.iommu_group)
            line = f"  {device.id:<{width}}  {device.health:<9}  numa={numa:<2} group={group:<4}"
            cdev = _cdev(device, resource.kind, snapshot, mdevs)
            if cdev is not None:
                line += f" cdev={(cdev.path or '-').removeprefix('/dev/vfio/devices/'):<6}"
            mdev = mdevs.get(device.id) if resource.kind is DeviceKind.MDEV else None
            if mdev is not None:
                line += f" type={mdev.type_id} parent={mdev.parent}"
            if device.reason:
                line += f"  {device.reason}"
            if cdev is not None and cdev.reason:
                line += f"  [no cdev: {cdev.reason}]"
            lines.append(line.rstrip())
    if inventory.skipped:
        lines.append("skipped:")
        for skipped in inventory.skipped:
            target = f" -> {skipped.resource_name}" if skipped.resource_name else ""
            lines.append(f"  {skipped.id}{target}: {skipped.reason}")
    binds = [decision for decision in (plan or {}).values() if decision.binds]
    if binds:
        lines.append(f"serve would move to {VFIO_DRIVER} (scan changes nothing):")
        for decision in binds:
            lines.append(f"  {decision.address}: from {decision.driver or 'no driver'}")
    lines.append(_iommufd_line(snapshot))
    if snapshot.problems:
        lines.append("problems reading the host:")
        for problem in snapshot.problems:
            lines.append(f"  {problem.path}: {problem.reason}")
    if not inventory.resources:
        lines.insert(0, "no resources would be advertised")
    return "\n".join(lines)
