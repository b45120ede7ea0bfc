"""Why an answer is empty or short: each config entry and the host, as this host answers them.

An entry that selects nothing (with the nearest ID or mdev type name the host
has), an entry left to KubeVirt's virt-handler or another plugin, a host
without PCI functions or IOMMU groups. These are read off the config and the
snapshot; nothing here decides what is served (that is `build_inventory`).
`dp-server scan` prints them, and `serve` logs them (`explain.changes`).
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Iterable, Sequence

import attrs

from ..config import Config, MediatedDevice, PciHostDevice
from ..host import VFIO_DRIVER, HostSnapshot
from ..host.pci import PciId

__all__ = ["EntryReport", "entry_reports", "host_findings", "host_notes"]


@attrs.frozen
class EntryReport:
    """One `pciHostDevices[]` or `mediatedDevices[]` entry, as this host answers it."""

    where: str  # pciHostDevices[0]
    selector: str
    resource: str | None
    served_by: str  # "dp", "virt-handler" or "another plugin"
    why: str
    devices: int  # functions or mdevs it selects here
    note: str = ""  # what else to know: nothing matches (and the nearest), the front end
    nearest: str | None = None


def _plural(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def _nearest(wanted: str, present: Iterable[str], same_prefix: str = "") -> str | None:
    """The present name most like `wanted`; one sharing `same_prefix` first."""
    names = sorted(set(present))
    if same_prefix:
        alike = [name for name in names if name.startswith(same_prefix)]
        found = difflib.get_close_matches(wanted, alike, n=1, cutoff=0.0)
        if found:
            return found[0]
    found = difflib.get_close_matches(wanted, names, n=1, cutoff=0.6)
    return found[0] if found else None


def _pci_report(where: str, entry: PciHostDevice, by_id: Counter[tuple[int, int]]) -> EntryReport:
    wanted = entry.pci_vendor_selector
    selector = str(wanted).upper()
    report = _report(where, selector, entry, by_id.get((wanted.vendor, wanted.device), 0))
    if report.devices:
        return report
    # Named only here: `serve` explains at every rebuild, most often with a match.
    ids = Counter({str(PciId(*key)).upper(): count for key, count in by_id.items()})
    nearest = _nearest(selector, ids, same_prefix=selector[:5])
    note = f"no PCI function on this host has the ID {selector}"
    if nearest is not None:
        note += f"; the nearest is {nearest} ({_plural(ids[nearest], 'function', 'functions')})"
    return attrs.evolve(report, note=note, nearest=nearest)


def _mdev_report(
    where: str, entry: MediatedDevice, snapshot: HostSnapshot, made: Counter[str]
) -> EntryReport:
    selector = entry.mdev_name_selector
    report = _report(where, selector, entry, made.get(selector.strip(), 0))
    if report.devices:
        return report
    offered = [t for t in snapshot.mdev_types if t.name.strip() == selector.strip()]
    if offered:
        parents = ", ".join(sorted({str(t.parent) for t in offered}))
        note = (
            f"no mdev of type {selector!r} exists; {parents} can make them "
            "(KubeVirt's mediatedDevicesConfiguration, or the type's create file)"
        )
        return attrs.evolve(report, note=note)
    names = set(made) | {t.name.strip() for t in snapshot.mdev_types}
    nearest = _nearest(selector.strip(), names)
    note = f"no mdev type on this host is named {selector!r}"
    if nearest is not None:
        note += f"; the nearest is {nearest!r} ({_plural(made[nearest], 'mdev', 'mdevs')})"
    return attrs.evolve(report, note=note, nearest=nearest)


def _report(
    where: str, selector: str, entry: PciHostDevice | MediatedDevice, devices: int
) -> EntryReport:
    served_by = (
        "virt-handler"
        if entry.virt_handler_serves
        else "another plugin"
        if entry.another_plugin
        else "dp"
    )
    through_dra = served_by == "dp" and entry.frontend == "dra" and devices > 0
    note = "offered through DRA (frontend: dra)" if through_dra else ""
    return EntryReport(
        where, selector, entry.resource_name, served_by, entry.served_because, devices, note
    )


def entry_reports(config: Config, snapshot: HostSnapshot) -> list[EntryReport]:
    """Each entry of `permittedHostDevices`: who serves it, and what it selects here."""
    permitted = config.permitted_host_devices
    if permitted is None:
        return []
    ids = Counter((pci.vendor, pci.device) for pci in snapshot.pci_devices if not pci.is_bridge)
    made: Counter[str] = Counter()
    for mdev in snapshot.mdevs:
        name = snapshot.mdev_type_name(mdev)
        if name is not None:
            made[name.strip()] += 1
    reports = [
        _pci_report(f"pciHostDevices[{index}]", entry, ids)
        for index, entry in enumerate(permitted.pci_host_devices)
    ]
    reports += [
        _mdev_report(f"mediatedDevices[{index}]", entry, snapshot, made)
        for index, entry in enumerate(permitted.mediated_devices)
    ]
    return reports


def host_findings(
    config: Config, snapshot: HostSnapshot, sysfs: str, root_problems: Sequence[str] = ()
) -> list[tuple[str, str]]:
    """(what, why) of each thing about the host itself that explains a short
    answer; `what` is a short name for logs (`no-iommu-groups`)."""
    if root_problems:
        return []  # the sysfs root is wrong: nothing below it means anything
    functions = [pci for pci in snapshot.pci_devices if not pci.is_bridge]
    found = []
    if not snapshot.pci_devices:
        found.append(("no-pci-functions", f"no PCI functions under {sysfs}/bus/pci/devices"))
    elif not snapshot.iommu_groups:
        found.append(
            (
                "no-iommu-groups",
                f"no IOMMU groups under {sysfs}/kernel/iommu_groups: the IOMMU is off "
                "(or the machine has none), so no device can be passed through with VFIO; turn "
                "on VT-d or AMD-Vi in the firmware and boot with intel_iommu=on (Intel)",
            )
        )
    if config.permitted_host_devices is None and functions:
        on_vfio = sum(1 for pci in functions if pci.driver == VFIO_DRIVER)
        if not on_vfio:
            found.append(
                (
                    "nothing-on-vfio-pci",
                    "without permittedHostDevices dp serves the PCI functions bound to vfio-pci, "
                    f"and none of this host's {_plural(len(functions), 'function', 'functions')} "
                    "is",
                )
            )
    return found


def host_notes(
    config: Config, snapshot: HostSnapshot, sysfs: str, root_problems: Sequence[str] = ()
) -> list[str]:
    """What about the host itself explains a short answer."""
    return [why for _, why in host_findings(config, snapshot, sysfs, root_problems)]
