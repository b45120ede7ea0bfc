"""What `dp-server scan` prints: the inventory as JSON (via cattrs) or a table,
with what explains it (`explain`): who serves each config entry and what it
selects here, the config's notes, and what about the host shortens the answer."""

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
    DeviceClass,
    DeviceKind,
    HostSnapshot,
    Inventory,
    MdevDevice,
    PciAddress,
    PciDevice,
    ScanProblem,
    cdev_state,
)
from dp_core.dra import device_class_name
from dp_core.explain import EntryReport
from dp_server.cli.explain import Explained

__all__ = [
    "explained_lines",
    "frontend_rows",
    "inventory_document",
    "inventory_table",
    "report_converter",
]

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


def _host_device(
    device: AdvertisedDevice, device_class: DeviceClass, snapshot: HostSnapshot
) -> PciDevice | MdevDevice | None:
    """The host's device an advertised ID names (None: its class has none)."""
    found = device_class.host_device
    return None if found is None else found(device.id, snapshot)


def _cdev(found: PciDevice | MdevDevice | None, snapshot: HostSnapshot) -> CdevState | None:
    """The VFIO character device of a function or an mdev (None if neither)."""
    return None if found is None else cdev_state(found, snapshot)


def _devices(
    device_class: DeviceClass, devices: Any, snapshot: HostSnapshot
) -> list[dict[str, Any]]:
    documents: list[dict[str, Any]] = report_converter.unstructure(list(devices))
    if device_class.host_device is None:
        return documents
    for device, document in zip(devices, documents, strict=True):
        found = _host_device(device, device_class, snapshot)
        if isinstance(found, MdevDevice):
            # The type and the parent by the kernel's names (a parent may be no PCI function).
            document["mdev_type"] = found.type_id
            document["parent"] = found.parent
        cdev = _cdev(found, snapshot)
        if cdev is not None:
            document["cdev"] = cdev.path
            if cdev.reason:
                document["cdev_reason"] = cdev.reason
    return documents


def _iommufd_line(snapshot: HostSnapshot) -> str:
    if snapshot.has_iommufd:
        return f"{IOMMUFD_NODE}: present (the kernel has iommufd)"
    return f"{IOMMUFD_NODE}: absent (no iommufd: the interface `iommufd` cannot serve here)"


def _entry(report: EntryReport) -> dict[str, Any]:
    document: dict[str, Any] = {
        "entry": report.where,
        "selector": report.selector,
        "resource": report.resource,
        "served_by": report.served_by,
        "why": report.why,
        "devices": report.devices,
    }
    if report.note:
        document["note"] = report.note
    if report.nearest is not None:
        document["nearest"] = report.nearest
    return document


report_converter.register_unstructure_hook(EntryReport, _entry)


def _config_document(explained: Explained) -> dict[str, Any]:
    return {
        "source": explained.config.source,
        "kubevirt_cr": explained.config.kubevirt_cr,
        "entries": [report_converter.unstructure(e, EntryReport) for e in explained.entries],
        "notes": [
            {"level": note.level, "path": note.path, "message": note.message}
            for note in explained.notes
        ],
    }


def frontend_rows(inventory: Inventory, driver: str | None) -> list[dict[str, Any]]:
    """Each resource of the whole inventory: the front end that serves it and,
    for DRA, the DeviceClass a cluster needs for it (`dp-server device-classes`)."""
    rows = []
    for resource in inventory.resources:
        row: dict[str, Any] = {"resource": resource.name, "frontend": resource.frontend}
        if resource.frontend == "dra" and driver is not None:
            try:
                row["device_class"] = device_class_name(resource.name, driver)
            except ValueError as error:
                row["device_class"] = None
                row["device_class_problem"] = str(error)
        rows.append(row)
    return rows


def _frontend_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["front ends (a name is served by one; DRA needs the DeviceClass named):"]
    for row in rows:
        line = f"  {row['resource']}: {row['frontend']}"
        if "device_class" in row:
            found = row["device_class"]
            line += f", DeviceClass {found}" if found else f", {row['device_class_problem']}"
        lines.append(line)
    return lines


def inventory_document(
    inventory: Inventory,
    snapshot: HostSnapshot,
    plan: Plan | None = None,
    explained: Explained | None = None,
    frontends: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """`{"resources": [{"name", "kind", "capacity", "allocatable", "devices"}], ...}`.

    A PCI device or an mdev says which VFIO character device it has (`cdev`,
    a path or null) and, without one, why (`cdev_reason`); an mdev, also its
    type (`mdev_type`) and its parent device (`parent`); `iommufd` says
    whether `/dev/iommu` exists.

    With a binding plan, `"binding"` lists what `serve` would move to vfio-pci
    and what it refuses to, with the reason.

    With `frontends` (`frontend_rows`), `"frontends"` says which front end
    serves each resource, and the DeviceClass a DRA one needs.

    With `explained`, `"config"` has each entry (who serves it and why, how
    many devices it selects here, and for one that selects none, the nearest
    ID or mdev type name there is) and the config's notes; `"host_notes"` says
    what about the host shortens the answer (no IOMMU groups, say).
    """
    resources = [
        {
            "name": resource.name,
            "kind": resource.kind.value,
            "capacity": len(resource.devices),
            "allocatable": resource.healthy_count,
            "devices": _devices(resource.device_class, resource.devices, snapshot),
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
    if frontends is not None:
        document["frontends"] = frontends
    if explained is not None:
        document["config"] = _config_document(explained)
        document["host_notes"] = list(explained.host)
    return document


def _count(report: EntryReport) -> str:
    """What the entry's selector matches on this host: not what is advertised
    (a device a host driver holds is selected, and skipped)."""
    one, many = ("function", "functions") if report.where.startswith("pci") else ("mdev", "mdevs")
    return f"selects {report.devices} {one if report.devices == 1 else many} here"


def explained_lines(explained: Explained) -> list[str]:
    """The config's entries and notes, and the host's notes, as report lines."""
    lines: list[str] = []
    loaded = explained.config
    if loaded.source is not None:
        kind = ", a KubeVirt CR read as KubeVirt reads it" if loaded.kubevirt_cr else ""
        lines.append(f"config {loaded.source}{kind}:")
    elif explained.entries or explained.notes:
        lines.append("config:")
    for report in explained.entries:
        served = "for dp" if report.served_by == "dp" else f"left to {report.served_by}"
        name = report.resource or "(a derived name)"
        line = f"  {report.where}  {report.selector} -> {name}: {_count(report)}, {served}"
        lines.append(f"{line}: {report.why}")
        if report.note:
            lines.append(f"    {report.note}")
    for note in explained.notes:
        lines.append(f"  {note.level}: {note.path}: {note.message}")
    if explained.host:
        lines.append("the host:")
        lines += [f"  {note}" for note in explained.host]
    return lines


def inventory_table(
    inventory: Inventory,
    snapshot: HostSnapshot,
    plan: Plan | None = None,
    explained: Explained | None = None,
    frontends: list[dict[str, Any]] | None = None,
) -> str:
    lines: list[str] = []
    no_cdev_said: set[str] = set()  # each reason in full once, then "as above"
    for resource in inventory.resources:
        lines.append(
            f"{resource.name}  ({resource.kind.value}, {resource.healthy_count}/"
            f"{len(resource.devices)} healthy)"
        )
        shown = resource.devices
        device_class = resource.device_class
        if device_class.alike and len(shown) > 3:
            first = shown[0]
            state = first.health + (f": {first.reason}" if first.reason else "")
            lines.append(f"  {first.id} .. {shown[-1].id}  {len(shown)} devices  {state}")
            continue
        width = max(len(d.id) for d in shown) if shown else 0
        for device in shown:
            numa = "-" if device.numa_node is None else str(device.numa_node)
            group = "-" if device.iommu_group is None else str(device.iommu_group)
            line = f"  {device.id:<{width}}  {device.health:<9}  numa={numa:<2} group={group:<4}"
            found = _host_device(device, device_class, snapshot)
            cdev = _cdev(found, snapshot)
            if cdev is not None:
                line += f" cdev={(cdev.path or '-').removeprefix('/dev/vfio/devices/'):<6}"
            if isinstance(found, MdevDevice):
                line += f" type={found.type_id} parent={found.parent}"
            if device.reason:
                line += f"  {device.reason}"
            if cdev is not None and cdev.reason:
                said = cdev.reason in no_cdev_said
                line += f"  [no cdev: {'as above' if said else cdev.reason}]"
                no_cdev_said.add(cdev.reason)
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
    if frontends:
        lines += _frontend_lines(frontends)
    lines.append(_iommufd_line(snapshot))
    if explained is not None:
        lines += explained_lines(explained)
    if snapshot.problems:
        lines.append("problems reading the host:")
        for problem in snapshot.problems:
            lines.append(f"  {problem.path}: {problem.reason}")
    if not inventory.resources:
        why = " (why: below)" if len(lines) > 1 else ""
        lines.insert(0, f"no resources would be advertised{why}")
    return "\n".join(lines)
