"""The classes of device dp serves, as data: one row each (`CLASSES`).

Everything that differs between a PCI function, an mdev and a shared
character device is a field of its row, read where it matters: how its
devices are found (`read`), whether it is a VFIO device with an IOMMU group
that is held whole, what KubeVirt's variable for it is called, whether the
kubelet is offered preferred allocations, whether its devices are
interchangeable, and which of the host's devices an ID names. A new class is
a new row, with its reader (`readers`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from types import MappingProxyType

import attrs

from ..host.pci import PciAddress, PciDevice
from ..host.snapshot import HostSnapshot, MdevDevice
from .readers import Reader, read_mdevs, read_pci, read_shared

__all__ = ["CLASSES", "DeviceClass", "DeviceKind"]


class DeviceKind(enum.Enum):
    PCI = "pci"
    MDEV = "mdev"
    SHARED = "shared"


HostDevice = Callable[[str, HostSnapshot], "PciDevice | MdevDevice | None"]


@attrs.frozen
class DeviceClass:
    kind: DeviceKind
    title: str  # what a person calls it (the demo's sample pods, docs)
    read: Reader  # finds its devices: which the config selects, and their health
    # A VFIO device: in an IOMMU group, which one holder has whole (so a
    # reservation makes its siblings Unhealthy), with VFIO nodes and a
    # character device.
    vfio: bool
    # KubeVirt's variable listing a container's devices (`<prefix><NAME>`), if any.
    env_prefix: str | None
    # GetPreferredAllocation is offered: packing into NUMA nodes and groups matters.
    preferred_allocation: bool
    # Its devices are interchangeable copies of one node (listed as a range).
    alike: bool
    # The host's device an advertised ID names (None: no device of its own).
    host_device: HostDevice | None


def _pci(device_id: str, snapshot: HostSnapshot) -> PciDevice | None:
    try:
        return snapshot.device(PciAddress.parse(device_id))
    except ValueError:
        return None


def _mdev(device_id: str, snapshot: HostSnapshot) -> MdevDevice | None:
    return snapshot.mdev(device_id)


#: Every class, in the order the inventory reads them.
CLASSES: Mapping[DeviceKind, DeviceClass] = MappingProxyType(
    {
        DeviceKind.PCI: DeviceClass(
            DeviceKind.PCI,
            "PCI passthrough",
            read_pci,
            vfio=True,
            env_prefix="PCI_RESOURCE_",
            preferred_allocation=True,
            alike=False,
            host_device=_pci,
        ),
        DeviceKind.MDEV: DeviceClass(
            DeviceKind.MDEV,
            "mediated device (vGPU)",
            read_mdevs,
            vfio=True,
            env_prefix="MDEV_PCI_RESOURCE_",
            preferred_allocation=True,
            alike=False,
            host_device=_mdev,
        ),
        DeviceKind.SHARED: DeviceClass(
            DeviceKind.SHARED,
            "shared character devices",
            read_shared,
            vfio=False,
            env_prefix=None,
            preferred_allocation=False,
            alike=True,
            host_device=None,
        ),
    }
)
