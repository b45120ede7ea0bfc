"""VFIO character devices (issue 19): what Allocate gives and what health is, per interface.

A table: for each shape of a function's `vfio-dev/` entry (with `dev` and a
node; with `dev` and no node; without `dev`; none at all; unreadable) and for
two mdevs (one with its own character device, as Linux 6.12 gives an mdev of
its sample drivers; one without, as before 6.1), under each `vfio.interface`,
the device nodes an Allocate of that one device returns and whether the
device is Healthy. Driven through the Node, as the kubelet drives it, with no
event loop.
"""

from __future__ import annotations

import attrs
import pytest

from dp_core import (
    AllocateAnswer,
    Config,
    DeviceSpec,
    Effect,
    HostSnapshot,
    MdevDevice,
    MdevType,
    MediatedDevice,
    PciHostDevice,
    PermittedHostDevices,
    Reply,
    Vfio,
    VfioDevEntry,
    VfioInterface,
)

from core_builders import VF, VF_RESOURCE, live_node, pci, snapshot

VF_A = "0000:6b:00.1"  # vfio-dev/vfio0 with `dev`, and its node
VF_B = "0000:6b:00.2"  # vfio-dev/vfio1 with `dev`, no node
VF_C = "0000:6b:00.3"  # vfio-dev/vfio2 without `dev`
VF_D = "0000:6b:00.4"  # no vfio-dev entry
VF_E = "0000:6b:00.5"  # vfio-dev that could not be read
PARENT = "0000:86:00.0"
MDEV = "4b20d080-1b54-4048-85b3-a6a62d165c01"  # vfio-dev/vfio3 with `dev`, and its node
MDEV_B = "4b20d080-1b54-4048-85b3-a6a62d165c02"  # no vfio-dev entry
MDEV_RESOURCE = "nvidia.com/GRID_T4-1Q"

ENTRIES = {
    VF_A: VfioDevEntry("vfio0", has_dev=True),
    VF_B: VfioDevEntry("vfio1", has_dev=True),
    VF_C: VfioDevEntry("vfio2", has_dev=False),
    VF_D: None,
    VF_E: VfioDevEntry(problem="cannot list: permission denied"),
}
GROUPS = {VF_A: 108, VF_B: 109, VF_C: 110, VF_D: 111, VF_E: 112}


def host(*, iommu: bool = True) -> HostSnapshot:
    functions = [
        attrs.evolve(pci(address, VF, GROUPS[address], class_code=0x0B4000), vfio_dev=entry)
        for address, entry in ENTRIES.items()
    ]
    parent = pci(PARENT, VF, 134, driver="nvidia", numa=1)
    made = snapshot(
        [*functions, parent],
        mdev_types=(MdevType(parent.address, "nvidia-222", "GRID T4-1Q"),),
        mdevs=(
            MdevDevice(MDEV, parent.address, "nvidia-222", 300, VfioDevEntry("vfio3", True)),
            MdevDevice(MDEV_B, parent.address, "nvidia-222", 301),
        ),
    )
    # vfio0 has its node; vfio1 does not (kubevirt #18895's shape).
    extra = {"/dev/vfio/devices/vfio0", "/dev/vfio/devices/vfio3"}
    extra |= {"/dev/iommu"} if iommu else set()
    return attrs.evolve(made, dev_nodes=made.dev_nodes | extra)


def config(interface: VfioInterface | None) -> Config:
    permitted = PermittedHostDevices(
        pci_host_devices=(PciHostDevice(VF, VF_RESOURCE),),
        mediated_devices=(MediatedDevice("GRID T4-1Q", MDEV_RESOURCE),),
    )
    base = Config(permitted_host_devices=permitted, shared_devices=())
    return base if interface is None else attrs.evolve(base, vfio=Vfio(interface))


def allocated_paths(effects: list[Effect]) -> tuple[str, ...]:
    (reply,) = [e for e in effects if isinstance(e, Reply)]
    assert isinstance(reply.answer, AllocateAnswer), reply
    (container,) = reply.answer.containers
    assert all(
        spec == DeviceSpec(spec.host_path, spec.host_path, "mrw") for spec in container.devices
    )
    return tuple(spec.host_path for spec in container.devices)


GROUP = "/dev/vfio/vfio"
IOMMU = "/dev/iommu"
CDEV0 = "/dev/vfio/devices/vfio0"
CDEV3 = "/dev/vfio/devices/vfio3"

# (device, interface) -> (paths an Allocate of it alone returns, healthy, reason contains).
# None as the interface is the default: group+cdev, what KubeVirt 1.9's plugin gives.
TABLE: list[tuple[str, str, VfioInterface | None, tuple[str, ...], bool, str]] = [
    (VF_A, VF_RESOURCE, None, (GROUP, "/dev/vfio/108", CDEV0), True, ""),
    (VF_A, VF_RESOURCE, "group+cdev", (GROUP, "/dev/vfio/108", CDEV0), True, ""),
    (VF_A, VF_RESOURCE, "group", (GROUP, "/dev/vfio/108"), True, ""),
    (VF_A, VF_RESOURCE, "iommufd", (IOMMU, CDEV0), True, ""),
    (VF_B, VF_RESOURCE, "group+cdev", (GROUP, "/dev/vfio/109"), True, ""),
    (VF_B, VF_RESOURCE, "group", (GROUP, "/dev/vfio/109"), True, ""),
    (
        VF_B,
        VF_RESOURCE,
        "iommufd",
        (IOMMU,),
        False,
        "no VFIO character device: /dev/vfio/devices/vfio1 does not exist",
    ),
    (VF_C, VF_RESOURCE, "group+cdev", (GROUP, "/dev/vfio/110"), True, ""),
    (VF_C, VF_RESOURCE, "group", (GROUP, "/dev/vfio/110"), True, ""),
    (VF_C, VF_RESOURCE, "iommufd", (IOMMU,), False, "vfio-dev/vfio2 has no dev file"),
    (VF_D, VF_RESOURCE, "group+cdev", (GROUP, "/dev/vfio/111"), True, ""),
    (VF_D, VF_RESOURCE, "iommufd", (IOMMU,), False, "no vfio-dev entry in sysfs"),
    (VF_E, VF_RESOURCE, "group+cdev", (GROUP, "/dev/vfio/112"), True, ""),
    (VF_E, VF_RESOURCE, "iommufd", (IOMMU,), False, "vfio-dev cannot be read: cannot list"),
    # An mdev is a VFIO device of its own: its nodes follow the interface too.
    (MDEV, MDEV_RESOURCE, "group+cdev", (GROUP, "/dev/vfio/300", CDEV3), True, ""),
    (MDEV, MDEV_RESOURCE, "group", (GROUP, "/dev/vfio/300"), True, ""),
    (MDEV, MDEV_RESOURCE, "iommufd", (IOMMU, CDEV3), True, ""),
    (MDEV_B, MDEV_RESOURCE, "group+cdev", (GROUP, "/dev/vfio/301"), True, ""),
    (
        MDEV_B,
        MDEV_RESOURCE,
        "iommufd",
        (IOMMU,),
        False,
        "no VFIO character device: no vfio-dev entry in sysfs (Linux before 6.1)",
    ),
]


@pytest.mark.parametrize(
    ("device", "resource", "interface", "paths", "healthy", "reason"),
    TABLE,
    ids=[f"{row[0][-6:]}-{row[2] or 'default'}" for row in TABLE],
)
def test_allocate_and_health_follow_the_interface(
    device: str,
    resource: str,
    interface: VfioInterface | None,
    paths: tuple[str, ...],
    healthy: bool,
    reason: str,
) -> None:
    node, kubelet = live_node(config(interface), host())
    (advertised,) = [d for d in node.device_plugin.advertised(resource) if d.id == device]
    assert advertised.healthy is healthy
    if healthy:
        assert advertised.reason == ""
        assert allocated_paths(kubelet.allocate(resource, (device,))) == paths
    else:
        assert reason in advertised.reason
        assert advertised.host_paths == paths


@pytest.mark.parametrize("interface", ["group", "group+cdev"])
def test_group_interfaces_do_not_need_dev_iommu(interface: VfioInterface) -> None:
    node, kubelet = live_node(config(interface), host(iommu=False))
    assert all(d.healthy for d in node.device_plugin.advertised(VF_RESOURCE))
    assert IOMMU not in allocated_paths(kubelet.allocate(VF_RESOURCE, (VF_A,)))


def test_iommufd_without_dev_iommu_is_unhealthy_with_the_reason() -> None:
    node, _ = live_node(config("iommufd"), host(iommu=False))
    (device,) = [d for d in node.device_plugin.advertised(VF_RESOURCE) if d.id == VF_A]
    assert not device.healthy
    assert device.reason.startswith("/dev/iommu does not exist")


def test_iommufd_still_needs_a_viable_group() -> None:
    made = host()
    blocker = pci("0000:6b:00.7", VF, 108, driver="qat_4xxxvf", class_code=0x0B4000)
    groups = [
        attrs.evolve(g, members=(*g.members, blocker)) if g.number == 108 else g
        for g in made.iommu_groups
    ]
    blocked = attrs.evolve(made, pci_devices=(*made.pci_devices, blocker), iommu_groups=groups)
    node, _ = live_node(config("iommufd"), blocked)
    (device,) = [d for d in node.device_plugin.advertised(VF_RESOURCE) if d.id == VF_A]
    assert not device.healthy
    assert device.reason == "IOMMU group 108 is not viable: 0000:6b:00.7 is bound to qat_4xxxvf"


def test_allocate_of_several_functions_gives_each_cdev_once_in_request_order() -> None:
    made = host()
    extra = attrs.evolve(
        pci("0000:6b:00.6", VF, 113, class_code=0x0B4000), vfio_dev=VfioDevEntry("vfio6", True)
    )
    groups = (*made.iommu_groups, attrs.evolve(made.iommu_groups[0], number=113, members=(extra,)))
    nodes = made.dev_nodes | {"/dev/vfio/113", "/dev/vfio/devices/vfio6"}
    bigger = attrs.evolve(
        made, pci_devices=(*made.pci_devices, extra), iommu_groups=groups, dev_nodes=nodes
    )
    _, kubelet = live_node(config(None), bigger)
    paths = allocated_paths(kubelet.allocate(VF_RESOURCE, ("0000:6b:00.6", VF_B, VF_A)))
    assert paths == (
        GROUP,
        "/dev/vfio/113",
        "/dev/vfio/devices/vfio6",
        "/dev/vfio/109",
        "/dev/vfio/108",
        CDEV0,
    )
    _, kubelet = live_node(config("iommufd"), bigger)
    paths = allocated_paths(kubelet.allocate(VF_RESOURCE, ("0000:6b:00.6", VF_A)))
    assert paths == (IOMMU, "/dev/vfio/devices/vfio6", CDEV0)
