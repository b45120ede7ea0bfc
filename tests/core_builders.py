"""Small hand-made hosts for core tests, independent of the fixture tree."""

from __future__ import annotations

from dp_core import (
    Config,
    HostSnapshot,
    IommuGroup,
    MdevDevice,
    MdevType,
    PciAddress,
    PciDevice,
    PciHostDevice,
    PciId,
    PermittedHostDevices,
)

GPU = PciId(0x10DE, 0x1EB8)
AUDIO = PciId(0x10DE, 0x10F8)
VF = PciId(0x8086, 0x4941)
GPU_RESOURCE = "nvidia.com/T4"
VF_RESOURCE = "intel.com/qat_vf"


def pci(
    address: str,
    pci_id: PciId,
    group: int | None,
    driver: str | None = "vfio-pci",
    numa: int | None = 0,
    class_code: int = 0x030200,
) -> PciDevice:
    return PciDevice(
        address=PciAddress.parse(address),
        vendor=pci_id.vendor,
        device=pci_id.device,
        class_code=class_code,
        driver=driver,
        iommu_group=group,
        numa_node=numa,
    )


def snapshot(
    devices: list[PciDevice],
    *,
    mdev_types: tuple[MdevType, ...] = (),
    mdevs: tuple[MdevDevice, ...] = (),
    missing_nodes: tuple[str, ...] = (),
    extra_nodes: tuple[str, ...] = ("/dev/kvm", "/dev/net/tun", "/dev/vhost-net"),
) -> HostSnapshot:
    groups: dict[int, list[PciDevice]] = {}
    for device in devices:
        if device.iommu_group is not None:
            groups.setdefault(device.iommu_group, []).append(device)
    for mdev in mdevs:
        if mdev.iommu_group is not None:
            groups.setdefault(mdev.iommu_group, [])
    nodes = {"/dev/vfio/vfio", *extra_nodes}
    nodes |= {f"/dev/vfio/{number}" for number in groups}
    nodes -= set(missing_nodes)
    return HostSnapshot(
        pci_devices=devices,
        iommu_groups=[IommuGroup(n, members) for n, members in sorted(groups.items()) if members],
        mdev_types=mdev_types,
        mdevs=mdevs,
        dev_nodes=frozenset(nodes),
    )


def gpu_config(**kwargs: object) -> Config:
    return Config(
        permitted_host_devices=PermittedHostDevices(
            pci_host_devices=(
                PciHostDevice(GPU, GPU_RESOURCE),
                PciHostDevice(VF, VF_RESOURCE),
            )
        ),
        **kwargs,  # type: ignore[arg-type]
    )


def two_gpus_and_vfs() -> HostSnapshot:
    """Two T4s each grouped with an audio function, and four QAT VFs (NUMA 0 and 1)."""
    return snapshot(
        [
            pci("0000:3b:00.0", GPU, 10, numa=0),
            pci("0000:3b:00.1", AUDIO, 10, numa=0, class_code=0x040300),
            pci("0000:af:00.0", GPU, 20, numa=1),
            pci("0000:af:00.1", AUDIO, 20, numa=1, class_code=0x040300),
            pci("0000:3d:01.0", VF, 30, numa=0, class_code=0x0B4000),
            pci("0000:3d:01.1", VF, 31, numa=0, class_code=0x0B4000),
            pci("0000:3d:01.2", VF, 32, numa=1, class_code=0x0B4000),
            pci("0000:3d:01.3", VF, 33, numa=1, class_code=0x0B4000),
        ]
    )
