"""Which VFIO device nodes a container needs for a PCI function or an mdev,
and whether they are there (`Config.vfio.interface`, docs/design.md §9)."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ..config.config import VfioInterface
from ..host.pci import PciDevice
from ..host.snapshot import IOMMUFD_NODE, HostSnapshot, MdevDevice

__all__ = ["VFIO_CONTAINER", "VFIO_PERMISSIONS", "CdevState", "cdev_state", "vfio_paths"]

VFIO_CONTAINER = "/dev/vfio/vfio"
# KubeVirt hands out VFIO nodes with mknod rights too.
VFIO_PERMISSIONS = "mrw"


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


def vfio_paths(
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
