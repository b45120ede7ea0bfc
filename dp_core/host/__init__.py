"""The host as the core sees it: PCI functions and their addresses, IOMMU
groups, mdevs and /dev nodes, as one observation (`HostSnapshot`)."""

from .pci import PciAddress, PciDevice, PciId, VfioDevEntry
from .snapshot import (
    IOMMUFD_NODE,
    VFIO_DRIVER,
    HostSnapshot,
    IommuGroup,
    MdevDevice,
    MdevType,
    ScanProblem,
    Viability,
    blocks_vfio,
)

__all__ = [
    "IOMMUFD_NODE",
    "VFIO_DRIVER",
    "HostSnapshot",
    "IommuGroup",
    "MdevDevice",
    "MdevType",
    "PciAddress",
    "PciDevice",
    "PciId",
    "ScanProblem",
    "VfioDevEntry",
    "Viability",
    "blocks_vfio",
]
